// Compiles the executables' precompiled header (see CMakeLists.txt).
