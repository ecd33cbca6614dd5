// The Python module resident_trainer._C. It exports nothing itself: loading it
// runs the TORCH_LIBRARY registrations of the other translation units, after
// which the kernels are reachable as torch.ops.resident_trainer.*.
#include <Python.h>

static struct PyModuleDef rt_module = {PyModuleDef_HEAD_INIT, "_C",
                                       "resident_trainer compiled kernels", -1, nullptr};

PyMODINIT_FUNC PyInit__C(void) { return PyModule_Create(&rt_module); }
