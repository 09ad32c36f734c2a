// The extensions' Python modules (selscan_fused._C and selscan_fused._fused): empty on purpose.
// Importing one loads its shared library, whose static initialisers register its ops with
// torch.library. TORCH_EXTENSION_NAME is set by the build to the module's name.
#include <Python.h>

#define SELSCAN_CONCAT_(a, b) a##b
#define SELSCAN_CONCAT(a, b) SELSCAN_CONCAT_(a, b)
#define SELSCAN_STR_(a) #a
#define SELSCAN_STR(a) SELSCAN_STR_(a)

extern "C" PyMODINIT_FUNC SELSCAN_CONCAT(PyInit_, TORCH_EXTENSION_NAME)(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, SELSCAN_STR(TORCH_EXTENSION_NAME),
                                          "selscan_fused CUDA ops", -1, nullptr};
  return PyModule_Create(&module_def);
}
