#include <pybind11/pybind11.h>
PYBIND11_MODULE(LLOYAL_MODULE_NAME, m) { m.attr("variant") = LLOYAL_VARIANT_NAME; }
