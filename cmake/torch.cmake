# Finds LibTorch so that a build uses one LibTorch only: its headers, its
# libraries, its Gloo headers.
#
# Three routes:
# - Debian's libtorch-dev (1.13): find_package(Torch) finds it in /usr.
# - Torch_DIR set by the user (a LibTorch 2.x archive, or pip's torch:
#   `python -c 'import torch;print(torch.utils.cmake_prefix_path)'`/Torch).
# - A pip build (scikit-build-core sets SKBUILD): the torch of the Python
#   environment being installed into, asked through that interpreter.
#
# TorchConfig.cmake looks its libraries up with find_library(... PATHS
# <prefix>/lib), which searches the system directories first: on a machine
# with Debian's libtorch-dev, a build against another LibTorch would link
# /usr/lib/x86_64-linux-gnu/libc10.so (1.13) beside that LibTorch's headers.
# The cache variables it fills are set here first, from <prefix>/lib only.
#
# Sets FASTATTN_TORCH_VERSION (e.g. 2.15.0+cu132, or empty where unknown).

set(FASTATTN_TORCH_VERSION "")
if(SKBUILD)  # asked at every configure: the environment may have changed
  # pip's build isolation hides the environment's site-packages through
  # PYTHONPATH and a sitecustomize; -I (isolated mode) ignores both, so this is
  # the torch installed where the package goes, never one downloaded for the
  # build.
  execute_process(
    COMMAND "${Python_EXECUTABLE}" -I -c
            "import torch; print(torch.utils.cmake_prefix_path); print(torch.__version__)"
    OUTPUT_VARIABLE _fastattn_torch_out
    ERROR_VARIABLE _fastattn_torch_err
    RESULT_VARIABLE _fastattn_torch_rc
    OUTPUT_STRIP_TRAILING_WHITESPACE)
  if(NOT _fastattn_torch_rc EQUAL 0)
    message(FATAL_ERROR
      "fastattn: cannot import torch with ${Python_EXECUTABLE}:\n${_fastattn_torch_err}\n"
      "Install PyTorch 2.x into this environment first (pip install torch), then "
      "pip install --no-build-isolation .")
  endif()
  string(REPLACE "\n" ";" _fastattn_torch_out "${_fastattn_torch_out}")
  list(GET _fastattn_torch_out 0 _fastattn_prefix_path)
  list(GET _fastattn_torch_out 1 FASTATTN_TORCH_VERSION)
  set(Torch_DIR "${_fastattn_prefix_path}/Torch" CACHE PATH "LibTorch's CMake config" FORCE)
  message(STATUS "fastattn: building against torch ${FASTATTN_TORCH_VERSION} (${Torch_DIR})")
endif()

# A LibTorch archive or pip's torch: <prefix>/share/cmake/Torch beside
# <prefix>/lib (Debian's is laid out differently and needs none of this).
if(DEFINED Torch_DIR)
  get_filename_component(_fastattn_prefix "${Torch_DIR}/../../.." ABSOLUTE)
  if(EXISTS "${_fastattn_prefix}/lib/${CMAKE_SHARED_LIBRARY_PREFIX}c10${CMAKE_SHARED_LIBRARY_SUFFIX}")
    set(_fastattn_torch_prefix "${_fastattn_prefix}")
  endif()
endif()
if(DEFINED _fastattn_torch_prefix)
  # The names TorchConfig.cmake gives its find_library results; found again
  # when the build directory is reused for another LibTorch.
  set(_fastattn_pins TORCH_LIBRARY:torch c10_LIBRARY:c10 C10_CUDA_LIBRARY:c10_cuda
                     kineto_LIBRARY:kineto FASTATTN_TORCH_CPU_LIBRARY:torch_cpu)
  if(NOT "${FASTATTN_TORCH_PREFIX}" STREQUAL "${_fastattn_torch_prefix}")
    foreach(_pair ${_fastattn_pins})
      string(REGEX REPLACE ":.*" "" _var "${_pair}")
      unset(${_var} CACHE)
    endforeach()
    set(FASTATTN_TORCH_PREFIX "${_fastattn_torch_prefix}" CACHE INTERNAL "LibTorch of this build")
  endif()
  foreach(_pair ${_fastattn_pins})
    string(REPLACE ":" ";" _pair "${_pair}")
    list(GET _pair 0 _var)
    list(GET _pair 1 _name)
    find_library(${_var} ${_name} PATHS "${_fastattn_torch_prefix}/lib" NO_DEFAULT_PATH)
  endforeach()
  # TorchConfig.cmake's find_package(Caffe2 PATHS ...) searches the system
  # first, and would take Debian's Caffe2 config (1.13, CPU-only) on a machine
  # that has libtorch-dev: point it at this LibTorch's own.
  if(EXISTS "${_fastattn_torch_prefix}/share/cmake/Caffe2/Caffe2Config.cmake")
    set(Caffe2_DIR "${_fastattn_torch_prefix}/share/cmake/Caffe2" CACHE PATH "LibTorch's Caffe2 config" FORCE)
  endif()
  if(NOT FASTATTN_TORCH_VERSION AND EXISTS "${_fastattn_torch_prefix}/version.py")
    file(STRINGS "${_fastattn_torch_prefix}/version.py" _fastattn_v REGEX "^__version__")
    string(REGEX REPLACE "^__version__ *= *['\"]([^'\"]*)['\"].*" "\\1" FASTATTN_TORCH_VERSION
                         "${_fastattn_v}")
  endif()
endif()

# A CPU-only build against a CUDA LibTorch (pip's default torch) does not go
# through TorchConfig.cmake: its Caffe2 part insists on a CUDA toolkit (nvcc)
# even for code that never touches CUDA. The target is described here
# instead, as torch.utils.cpp_extension does for CppExtension: LibTorch's
# include directories, its three core libraries, its ABI flag and its C++
# standard.
set(_fastattn_torch_light OFF)
if(DEFINED _fastattn_torch_prefix AND (FASTATTN_CUDA STREQUAL "OFF" OR NOT CMAKE_CUDA_COMPILER))
  set(_fastattn_torch_light ON)
endif()

if(_fastattn_torch_light)
  file(READ "${Torch_DIR}/TorchConfig.cmake" _fastattn_torch_config)
  set(TORCH_CXX_FLAGS "")
  if(_fastattn_torch_config MATCHES "set\\(TORCH_CXX_FLAGS \"([^\"]*)\"\\)")
    set(TORCH_CXX_FLAGS "${CMAKE_MATCH_1}")
  endif()
  set(TORCH_INCLUDE_DIRS "${_fastattn_torch_prefix}/include"
                         "${_fastattn_torch_prefix}/include/torch/csrc/api/include")
  if(NOT FASTATTN_TORCH_CPU_LIBRARY OR NOT TORCH_LIBRARY OR NOT c10_LIBRARY)
    message(FATAL_ERROR "fastattn: ${_fastattn_torch_prefix}/lib lacks libtorch, libtorch_cpu or libc10")
  endif()
  add_library(torch SHARED IMPORTED)
  set_target_properties(torch PROPERTIES
    IMPORTED_LOCATION "${TORCH_LIBRARY}"
    INTERFACE_INCLUDE_DIRECTORIES "${TORCH_INCLUDE_DIRS}"
    INTERFACE_LINK_LIBRARIES "${FASTATTN_TORCH_CPU_LIBRARY};${c10_LIBRARY}")
  if(TORCH_CXX_FLAGS)
    separate_arguments(_fastattn_flags UNIX_COMMAND "${TORCH_CXX_FLAGS}")
    set_property(TARGET torch APPEND PROPERTY INTERFACE_COMPILE_OPTIONS ${_fastattn_flags})
  endif()
  if(_fastattn_torch_config MATCHES "cxx_std_20")
    target_compile_features(torch INTERFACE cxx_std_20)
  endif()
  set(TORCH_LIBRARIES torch)
  set(Torch_FOUND TRUE)
  message(STATUS "fastattn: CPU-only build against ${_fastattn_torch_prefix} (no CUDA toolkit needed)")
else()
  find_package(Torch REQUIRED)
endif()

# Every library LibTorch brought must come from its own prefix.
if(DEFINED _fastattn_torch_prefix)
  foreach(_lib ${TORCH_LIBRARIES})
    if(_lib MATCHES "^/" AND NOT _lib MATCHES "^${_fastattn_torch_prefix}/"
       AND _lib MATCHES "(torch|c10|kineto)[^/]*$")
      message(FATAL_ERROR "fastattn: ${_lib} is not from ${_fastattn_torch_prefix}")
    endif()
  endforeach()
endif()
