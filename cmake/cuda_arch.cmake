# The CUDA architectures fastattn's kernels are compiled for (included from
# CMakeLists.txt's CUDA section, after CUDA is enabled).
#
# The list, in PyTorch's TORCH_CUDA_ARCH_LIST format ("7.5;8.0;8.6;9.0+PTX":
# semicolons or spaces, "+PTX" adds PTX for that architecture, "9.0a" and
# "10.0f" name the arch- and family-specific variants), comes from the first
# of:
#   1. TORCH_CUDA_ARCH_LIST given by the user, as a CMake variable or else in
#      the environment (FASTATTN_CUDA_ARCH_LIST_USER, recorded by
#      CMakeLists.txt before find_package(Torch));
#   2. with a CUDA LibTorch, the architectures that LibTorch was built for:
#      a. in a pip build (SKBUILD), torch.cuda.get_arch_list() of the
#         environment's torch (the interpreter cmake/torch.cmake asks too);
#      b. otherwise (a plain Torch_DIR build: pip's torch or a LibTorch
#         archive), the nvcc flags libtorch_cuda.so records (PyTorch's
#         build configuration string, "-gencode;arch=compute_75,code=sm_75;...",
#         the same list get_arch_list() derives from): no Python needed;
#      c. if neither can be read: 8.0;9.0+PTX (Ampere and Hopper code, PTX for
#         newer GPUs to compile at load time);
#   3. the compile check of a CPU LibTorch (fastattn_cuda_kernels): 9.0.
# Architectures of 2 that this nvcc cannot compile for are dropped with a
# warning; one given by the user (1) that it cannot compile for is an error.
#
# Caffe2's cuda.cmake (run by find_package(Torch)) has already put -gencode
# flags for its own TORCH_CUDA_ARCH_LIST into CMAKE_CUDA_FLAGS; they are
# removed here, and fastattn_cuda_architectures(<target>) gives a target this
# list's flags instead (CUDA_ARCHITECTURES OFF: CMake adds none of its own).
#
# Sets FASTATTN_CUDA_ARCH_LIST (the list as used, e.g. "7.5;8.0;9.0+PTX") and
# FASTATTN_CUDA_ARCH_SOURCE (where it came from).

# "sm_90a" / "compute_90" (torch's names) -> "9.0a" (without "+PTX").
function(_fastattn_cuda_arch_from_sm out name)
  if(NOT name MATCHES "^(sm|compute)_([0-9]+)([0-9])([af]?)$")
    set(${out} "" PARENT_SCOPE)
    return()
  endif()
  set(${out} "${CMAKE_MATCH_2}.${CMAKE_MATCH_3}${CMAKE_MATCH_4}" PARENT_SCOPE)
endfunction()

# Turns "sm_75 sm_80 compute_90" (torch.cuda.get_arch_list()) or the
# "code=sm_75 ... code=compute_90" of nvcc flags into "7.5;8.0;9.0+PTX".
function(_fastattn_cuda_arch_list_from_names out)
  set(real "")
  set(ptx "")
  foreach(name ${ARGN})
    _fastattn_cuda_arch_from_sm(arch "${name}")
    if(NOT arch)
      continue()
    endif()
    if(name MATCHES "^compute_")
      list(APPEND ptx "${arch}")
    else()
      list(APPEND real "${arch}")
    endif()
  endforeach()
  set(result "")
  foreach(arch ${real})
    if(arch IN_LIST ptx)
      list(APPEND result "${arch}+PTX")
      list(REMOVE_ITEM ptx "${arch}")
    else()
      list(APPEND result "${arch}")
    endif()
  endforeach()
  foreach(arch ${ptx})  # PTX without code of its own
    list(APPEND result "${arch}+PTX")
  endforeach()
  list(REMOVE_DUPLICATES result)
  set(${out} "${result}" PARENT_SCOPE)
endfunction()

# Parses a TORCH_CUDA_ARCH_LIST into nvcc flags. Entries nvcc cannot compile
# for are an error when `strict`, else dropped with a warning. Sets
# <out_list> (the entries kept), <out_flags> and <out_min> (the oldest
# architecture, as 75 for 7.5).
function(_fastattn_cuda_arch_flags out_list out_flags out_min list strict)
  execute_process(COMMAND "${CMAKE_CUDA_COMPILER}" --list-gpu-code
                  OUTPUT_VARIABLE nvcc_codes ERROR_QUIET RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    set(nvcc_codes "")  # an older nvcc: let it report unknown architectures itself
  endif()
  string(REGEX MATCHALL "sm_[0-9]+" nvcc_codes "${nvcc_codes}")
  string(REPLACE " " ";" list "${list}")
  set(kept "")
  set(flags "")
  set(min "")
  foreach(entry ${list})
    if(entry STREQUAL "")
      continue()
    endif()
    if(NOT entry MATCHES "^([0-9]+)\\.([0-9])([af]?)(\\+PTX)?$")
      message(FATAL_ERROR "fastattn: cannot read '${entry}' in the CUDA architecture list "
                          "'${list}': use compute capabilities such as 7.5;8.0;9.0+PTX")
    endif()
    set(num "${CMAKE_MATCH_1}${CMAKE_MATCH_2}")
    set(variant "${CMAKE_MATCH_3}")
    set(with_ptx "${CMAKE_MATCH_4}")
    if(nvcc_codes AND NOT "sm_${num}" IN_LIST nvcc_codes)
      string(REPLACE ";" " " known "${nvcc_codes}")
      set(msg "nvcc ${CMAKE_CUDA_COMPILER_VERSION} cannot compile for compute capability "
              "${CMAKE_MATCH_1}.${CMAKE_MATCH_2} (it knows ${known})")
      if(strict)
        message(FATAL_ERROR "fastattn: TORCH_CUDA_ARCH_LIST: " ${msg})
      endif()
      message(WARNING "fastattn: leaving out ${entry}: " ${msg})
      continue()
    endif()
    list(APPEND kept "${entry}")
    if(min STREQUAL "" OR num LESS min)
      set(min ${num})
    endif()
    list(APPEND flags "--generate-code=arch=compute_${num}${variant},code=sm_${num}${variant}")
    if(with_ptx)
      list(APPEND flags "--generate-code=arch=compute_${num}${variant},code=compute_${num}${variant}")
    endif()
  endforeach()
  if(NOT kept)
    message(FATAL_ERROR "fastattn: no CUDA architecture left to compile for (list: '${list}')")
  endif()
  set(${out_list} "${kept}" PARENT_SCOPE)
  set(${out_flags} "${flags}" PARENT_SCOPE)
  set(${out_min} "${min}" PARENT_SCOPE)
endfunction()

# ---- the list --------------------------------------------------------------
set(FASTATTN_CUDA_ARCH_LIST "")
set(_fastattn_arch_strict OFF)
if(NOT "${FASTATTN_CUDA_ARCH_LIST_USER}" STREQUAL "")
  set(FASTATTN_CUDA_ARCH_LIST "${FASTATTN_CUDA_ARCH_LIST_USER}")
  set(FASTATTN_CUDA_ARCH_SOURCE "TORCH_CUDA_ARCH_LIST")
  set(_fastattn_arch_strict ON)
elseif(NOT FASTATTN_WITH_CUDA)
  set(FASTATTN_CUDA_ARCH_LIST "9.0")
  set(FASTATTN_CUDA_ARCH_SOURCE "compile check default")
else()
  if(SKBUILD AND Python_EXECUTABLE)
    execute_process(
      COMMAND "${Python_EXECUTABLE}" -I -c "import torch; print(' '.join(torch.cuda.get_arch_list()))"
      OUTPUT_VARIABLE _fastattn_names ERROR_QUIET RESULT_VARIABLE _fastattn_rc
      OUTPUT_STRIP_TRAILING_WHITESPACE)
    if(_fastattn_rc EQUAL 0)
      string(REPLACE " " ";" _fastattn_names "${_fastattn_names}")
      _fastattn_cuda_arch_list_from_names(FASTATTN_CUDA_ARCH_LIST ${_fastattn_names})
      set(FASTATTN_CUDA_ARCH_SOURCE "torch.cuda.get_arch_list()")
    endif()
  endif()
  if(NOT FASTATTN_CUDA_ARCH_LIST AND TORCH_INSTALL_PREFIX)
    set(_fastattn_torch_cuda_lib
        "${TORCH_INSTALL_PREFIX}/lib/${CMAKE_SHARED_LIBRARY_PREFIX}torch_cuda${CMAKE_SHARED_LIBRARY_SUFFIX}")
    if(EXISTS "${_fastattn_torch_cuda_lib}")
      # The string sits in the library's read-only data; reading stops at
      # the first match (about 2 s for the 500 MB of torch 2.15's).
      file(STRINGS "${_fastattn_torch_cuda_lib}" _fastattn_flags
           REGEX "-gencode;arch=compute_[0-9]+[af]?,code=" LIMIT_COUNT 1)
      # The code= parts: sm_XY (machine code), compute_XY (PTX).
      string(REGEX REPLACE "arch=compute_[0-9]+[af]?" "" _fastattn_flags "${_fastattn_flags}")
      string(REGEX MATCHALL "(sm|compute)_[0-9]+[af]?" _fastattn_names "${_fastattn_flags}")
      _fastattn_cuda_arch_list_from_names(FASTATTN_CUDA_ARCH_LIST ${_fastattn_names})
      set(FASTATTN_CUDA_ARCH_SOURCE "the nvcc flags recorded in ${_fastattn_torch_cuda_lib}")
    endif()
  endif()
  if(NOT FASTATTN_CUDA_ARCH_LIST)
    set(FASTATTN_CUDA_ARCH_LIST "8.0;9.0+PTX")
    set(FASTATTN_CUDA_ARCH_SOURCE "default (LibTorch's own list not found)")
  endif()
endif()
_fastattn_cuda_arch_flags(FASTATTN_CUDA_ARCH_LIST _fastattn_cuda_gencode _fastattn_cuda_min_arch
                          "${FASTATTN_CUDA_ARCH_LIST}" ${_fastattn_arch_strict})
message(STATUS "fastattn: CUDA architectures ${FASTATTN_CUDA_ARCH_LIST} (${FASTATTN_CUDA_ARCH_SOURCE})")

# Caffe2's -gencode flags ("-gencode arch=compute_90,code=sm_90", appended
# to CMAKE_CUDA_FLAGS by torch_cuda_get_nvcc_gencode_flag) go.
string(REGEX REPLACE " *-gencode[ =]arch=[^ ]+" "" CMAKE_CUDA_FLAGS "${CMAKE_CUDA_FLAGS}")

# Also tells the kernels' launchers the oldest architecture
# (FASTATTN_CUDA_MIN_ARCH): where every architecture has a dtype's tensor
# cores they compile no fallback for it (src/kernels/common/cuda_compat.cuh).
function(fastattn_cuda_architectures target)
  set_target_properties(${target} PROPERTIES CUDA_ARCHITECTURES OFF)
  foreach(flag ${_fastattn_cuda_gencode})
    target_compile_options(${target} PRIVATE "$<$<COMPILE_LANGUAGE:CUDA>:${flag}>")
  endforeach()
  target_compile_definitions(${target} PRIVATE
    "$<$<COMPILE_LANGUAGE:CUDA>:FASTATTN_CUDA_MIN_ARCH=${_fastattn_cuda_min_arch}>")
endfunction()
