"""The C++ warm-call table (fastpath): build, load, and the native launch plans backends register with it.
Imports only kernels.core."""
