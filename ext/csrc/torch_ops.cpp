// The torch-facing sources, compiled as this one translation unit (setup.py builds it, not
// them one by one): alone, each spent most of its compile parsing the same torch headers.
// They share one scope here, so file-local names (static, anonymous namespace) must differ
// between them.
#include "schema.cpp"
#include "kv_plan.cpp"
#include "kv_ops.cpp"
#include "cpu_ops.cpp"
