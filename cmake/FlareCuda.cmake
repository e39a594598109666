# Whether this build has the CUDA backend, and for which GPUs: FLARE_CUDA (ON, OFF or AUTO) decides,
# FLARE_ENABLE_CUDA being the older spelling of ON/OFF. Included by the top-level CMakeLists.txt before src/.
#
# Sets, for the rest of the build (normal variables shadowing the cache):
#   FLARE_ENABLE_CUDA     ON or OFF: the decision
#   FLARE_CUDA_REASON     one line saying why, also in flare_build_config() (key cuda_reason)
#   FLARE_ARCHS           "native" resolved: this machine's GPUs of sm_80 and newer, or, with no such GPU here,
#                         FLARE_RELEASE_ARCHS
#
# AUTO builds the backend where nvcc 13 or newer is found: CMAKE_CUDA_COMPILER or CUDACXX if set, else nvcc on
# PATH, in $CUDA_HOME/bin, $CUDA_PATH/bin or /usr/local/cuda/bin. ON requires it; OFF builds the CPU backend only.
# A pip build with CUDA fetches the CUTLASS headers (nvidia-cutlass, with pip) unless FLARE_CUTLASS_DIR is set.

# The release wheel's architectures, and FLARE_ARCHS's default. sm_86 / sm_87 / sm_89 GPUs run the sm_80 cubin
# (the same instruction set; it holds the small-shared-memory kernels they pick, src/cuda/sm80/traits.cuh), as
# FlashAttention 2 ships them; adding 86 and 89 gives them cubins of their own for a longer build.
set(FLARE_RELEASE_ARCHS "80;90")
set(FLARE_CUDA_MIN_VERSION 13.0)       # the nvcc flare is built and tested with (docs/install.md)
set(FLARE_CUTLASS_VERSION 4.2.0.0)     # nvidia-cutlass, as scripts/ensure-cutlass.sh (a test checks they agree)

set(FLARE_CUDA "" CACHE STRING "The CUDA backend: ON, OFF or AUTO (ON where nvcc ${FLARE_CUDA_MIN_VERSION}+ is found); empty: FLARE_ENABLE_CUDA")
set_property(CACHE FLARE_CUDA PROPERTY STRINGS "" AUTO ON OFF)
string(TOUPPER "${FLARE_CUDA}" _flare_cuda_mode)
set(_flare_cuda_knob "FLARE_CUDA=${_flare_cuda_mode}")  # what decided, for the reason recorded below
if(_flare_cuda_mode STREQUAL "")
  if(FLARE_ENABLE_CUDA)
    set(_flare_cuda_mode ON)
  else()
    set(_flare_cuda_mode OFF)
  endif()
  set(_flare_cuda_knob "FLARE_ENABLE_CUDA=${_flare_cuda_mode} (FLARE_CUDA unset)")
endif()
if(NOT _flare_cuda_mode MATCHES "^(ON|OFF|AUTO)$")
  message(FATAL_ERROR "FLARE_CUDA is '${FLARE_CUDA}': it must be ON, OFF or AUTO")
endif()

# The nvcc a CUDA build would use, and its version ("" when none is found).
function(flare_find_nvcc out_path out_version)
  if(CMAKE_CUDA_COMPILER)
    set(nvcc ${CMAKE_CUDA_COMPILER})
  elseif(DEFINED ENV{CUDACXX} AND NOT "$ENV{CUDACXX}" STREQUAL "")
    set(nvcc $ENV{CUDACXX})
  else()
    find_program(FLARE_NVCC nvcc PATHS ENV CUDA_HOME ENV CUDA_PATH /usr/local/cuda PATH_SUFFIXES bin
                 DOC "nvcc for FLARE_CUDA=AUTO/ON")
    set(nvcc ${FLARE_NVCC})
  endif()
  set(version "")
  if(nvcc AND EXISTS "${nvcc}")
    execute_process(COMMAND "${nvcc}" --version OUTPUT_VARIABLE text ERROR_QUIET RESULT_VARIABLE rc)
    if(rc EQUAL 0 AND text MATCHES "release ([0-9]+\\.[0-9]+)")
      set(version ${CMAKE_MATCH_1})
    endif()
  endif()
  if(version STREQUAL "")
    set(nvcc "")
  endif()
  set(${out_path} "${nvcc}" PARENT_SCOPE)
  set(${out_version} "${version}" PARENT_SCOPE)
endfunction()

if(_flare_cuda_mode STREQUAL "OFF")
  set(FLARE_ENABLE_CUDA OFF)
  set(FLARE_CUDA_REASON "${_flare_cuda_knob}")
else()
  flare_find_nvcc(_flare_nvcc _flare_nvcc_version)
  if(NOT _flare_nvcc)
    set(_why "no nvcc found (looked at CMAKE_CUDA_COMPILER, CUDACXX, PATH, CUDA_HOME, CUDA_PATH, /usr/local/cuda)")
  elseif(_flare_nvcc_version VERSION_LESS FLARE_CUDA_MIN_VERSION)
    set(_why "nvcc ${_flare_nvcc_version} at ${_flare_nvcc} is older than CUDA ${FLARE_CUDA_MIN_VERSION}")
  else()
    set(_why "")
  endif()
  if(_why STREQUAL "")
    set(FLARE_ENABLE_CUDA ON)
    set(FLARE_CUDA_REASON "${_flare_cuda_knob}, nvcc ${_flare_nvcc_version} at ${_flare_nvcc}")
    set(CMAKE_CUDA_COMPILER "${_flare_nvcc}")
  elseif(_flare_cuda_mode STREQUAL "ON")
    message(FATAL_ERROR "flare: ${_flare_cuda_knob} but ${_why}. Install CUDA ${FLARE_CUDA_MIN_VERSION}+, point "
                        "CUDACXX or CMAKE_CUDA_COMPILER at its nvcc, or build the CPU backend alone with FLARE_CUDA=OFF.")
  else()
    set(FLARE_ENABLE_CUDA OFF)
    set(FLARE_CUDA_REASON "${_flare_cuda_knob} and ${_why}")
  endif()
endif()

if(FLARE_ENABLE_CUDA)
  enable_language(CUDA)
  # CMake 3.25 does not know nvcc 13's C++20 flag; teach it (newer CMake sets the same).
  if(NOT CMAKE_CUDA20_STANDARD_COMPILE_OPTION)
    set(CMAKE_CUDA20_STANDARD_COMPILE_OPTION "-std=c++20")
    set(CMAKE_CUDA20_EXTENSION_COMPILE_OPTION "-std=c++20")
  endif()
  set(CMAKE_CUDA_STANDARD 20)
  set(CMAKE_CUDA_STANDARD_REQUIRED ON)

  # A pip build (SKBUILD) fetches the CuTe/CUTLASS headers itself, as scripts/ensure-cutlass.sh does: the pip of
  # the build environment (pyproject.toml's build.requires), no dependencies, into this build tree, once.
  set(_local_cutlass ${PROJECT_SOURCE_DIR}/build/deps/cutlass/cutlass_library/source/include)
  if(SKBUILD AND NOT FLARE_CUTLASS_DIR AND NOT EXISTS ${_local_cutlass}/cute/tensor.hpp)
    set(_dest ${CMAKE_BINARY_DIR}/deps/cutlass)
    if(NOT EXISTS ${_dest}/cutlass_library/source/include/cute/tensor.hpp)
      message(STATUS "flare: fetching the CuTe/CUTLASS headers: pip install --no-deps nvidia-cutlass==${FLARE_CUTLASS_VERSION}")
      execute_process(COMMAND "${Python_EXECUTABLE}" -m pip install -q --no-deps --target "${_dest}"
                              nvidia-cutlass==${FLARE_CUTLASS_VERSION}
                      RESULT_VARIABLE _rc ERROR_VARIABLE _err)
      if(NOT _rc EQUAL 0)
        message(FATAL_ERROR "flare: fetching the CUTLASS headers with pip failed:\n${_err}\nSet FLARE_CUTLASS_DIR "
                            "to a CUTLASS 4.x include directory, or build without CUDA (FLARE_CUDA=OFF).")
      endif()
    endif()
    set(FLARE_CUTLASS_DIR ${_dest}/cutlass_library/source/include CACHE PATH
        "Directory holding cute/ and cutlass/ (CUTLASS 4.x include dir)" FORCE)
  endif()

  if(FLARE_ARCHS STREQUAL "native")
    # This machine's GPUs (e.g. "90-real;86-real"), those flare's kernels can run on: sm_80 and newer.
    set(_native "")
    set(_old "")
    foreach(a IN LISTS CMAKE_CUDA_ARCHITECTURES_NATIVE)
      string(REGEX REPLACE "-.*" "" a "${a}")
      if(a MATCHES "^[0-9]+$" AND a GREATER_EQUAL 80)
        list(APPEND _native ${a})
      elseif(NOT a STREQUAL "")
        list(APPEND _old ${a})
      endif()
    endforeach()
    list(REMOVE_DUPLICATES _native)
    if(_old)
      message(STATUS "flare: GPUs of sm_${_old} here are older than sm_80: no kernels for them")
    endif()
    if(_native)
      set(FLARE_ARCHS "${_native}")
      string(APPEND FLARE_CUDA_REASON ", FLARE_ARCHS=native: this machine's GPUs")
    else()
      set(FLARE_ARCHS "${FLARE_RELEASE_ARCHS}")
      string(APPEND FLARE_CUDA_REASON ", FLARE_ARCHS=native but no sm_80+ GPU here: the release list")
    endif()
  endif()
endif()

if(FLARE_ENABLE_CUDA)
  message(STATUS "flare: CUDA backend ON (${FLARE_CUDA_REASON})")
else()
  message(STATUS "flare: CUDA backend OFF, CPU backend only (${FLARE_CUDA_REASON})")
endif()
