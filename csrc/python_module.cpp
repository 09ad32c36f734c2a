// The extension's Python module: empty on purpose. Importing selscan_fused._C loads this shared
// library, whose static initialisers register the ops of csrc/torch_ops.cpp with torch.library.
#include <Python.h>

extern "C" PyMODINIT_FUNC PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", "selscan_fused CUDA ops", -1, nullptr};
  return PyModule_Create(&module_def);
}
