// Placeholder module; the scheduler bindings replace it.
#include <pybind11/pybind11.h>
PYBIND11_MODULE(_scheduler, m) { m.doc() = "Baton compiled scheduler"; }
