// Python module of selscan_fused._fused (the shared definition, compiled under this extension's name).
#include "../python_module.cpp"
