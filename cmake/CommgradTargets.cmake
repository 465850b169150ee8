# Helpers shared by every commgrad target.
#
# Every target that includes LibTorch reuses one precompiled header (the
# LibTorch headers cost ~30 s per translation unit otherwise), so all of them
# are compiled position-independent with the same flags.

set(COMMGRAD_PCH_HEADERS
  <torch/torch.h>
  <torch/csrc/distributed/c10d/ProcessGroup.hpp>)

set(COMMGRAD_WARNINGS -Wall -Wextra -Winvalid-pch)


if(COMMGRAD_SANITIZE STREQUAL "address")
  set(COMMGRAD_SANITIZER_FLAGS -fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=undefined)
elseif(COMMGRAD_SANITIZE STREQUAL "thread")
  set(COMMGRAD_SANITIZER_FLAGS -fsanitize=thread -fno-omit-frame-pointer)
elseif(COMMGRAD_SANITIZE)
  message(FATAL_ERROR "COMMGRAD_SANITIZE must be empty, 'address' or 'thread'")
endif()

# The PCH is opt-in: loading it costs ~10 s even for a file that needs none
# of it, so only translation units that include <torch/torch.h> (tests,
# examples, the nn-module layers) use it; they save ~10-20 s each. It is
# built once, by an object library, and reused; every user compiles with
# -fPIC (not -fPIE) so that the PCH stays valid for executables too.
set(COMMGRAD_PCH_OWNER "")
if(COMMGRAD_USE_PCH)
  add_library(commgrad_pch OBJECT ${PROJECT_SOURCE_DIR}/cmake/pch.cpp)
  target_compile_features(commgrad_pch PRIVATE cxx_std_${COMMGRAD_CXX_STANDARD})
  target_link_libraries(commgrad_pch PRIVATE ${TORCH_LIBRARIES})
  target_compile_options(commgrad_pch PRIVATE -fPIC ${COMMGRAD_SANITIZER_FLAGS})
  set_target_properties(commgrad_pch PROPERTIES CXX_EXTENSIONS OFF)
  target_precompile_headers(commgrad_pch PRIVATE ${COMMGRAD_PCH_HEADERS})
  set(COMMGRAD_PCH_OWNER commgrad_pch)
endif()

# commgrad_configure_target(<target> [PCH])
#   The C++ standard of the LibTorch found (COMMGRAD_CXX_STANDARD), warnings,
#   sanitizers, -fPIC, and with PCH the shared precompiled LibTorch headers.
#   Executables find the layers in ../lib once installed.
function(commgrad_configure_target target)
  cmake_parse_arguments(ARG "PCH;NO_TORCH" "" "" ${ARGN})
  target_compile_features(${target} PRIVATE cxx_std_${COMMGRAD_CXX_STANDARD})
  set_target_properties(${target} PROPERTIES CXX_EXTENSIONS OFF DEFINE_SYMBOL "")
  get_target_property(type ${target} TYPE)
  if(type STREQUAL "EXECUTABLE")
    set_target_properties(${target} PROPERTIES INSTALL_RPATH "$ORIGIN/../${CMAKE_INSTALL_LIBDIR};${COMMGRAD_TORCH_LIB_DIR}")
  endif()
  target_compile_options(${target} PRIVATE -fPIC ${COMMGRAD_WARNINGS} ${COMMGRAD_SANITIZER_FLAGS})
  if(COMMGRAD_SANITIZER_FLAGS)
    target_link_options(${target} PRIVATE ${COMMGRAD_SANITIZER_FLAGS})
  endif()
  if(COMMGRAD_TORCH_LINK_OPTIONS AND NOT ARG_NO_TORCH)
    target_link_options(${target} PRIVATE ${COMMGRAD_TORCH_LINK_OPTIONS})
  endif()
  if(ARG_PCH AND COMMGRAD_PCH_OWNER)
    target_precompile_headers(${target} REUSE_FROM ${COMMGRAD_PCH_OWNER})
  endif()
endfunction()

# commgrad_unity_build(<target>)
#   With COMMGRAD_UNITY_BUILD the target's sources compile in batches of 8: a
#   layer's file spends ~8 of its ~12 s parsing the LibTorch headers, so a
#   batch parses them once (the PCH does not help there: loading it costs
#   ~5 s), and a test program loads the PCH and GoogleTest once.
function(commgrad_unity_build target)
  if(COMMGRAD_UNITY_BUILD)
    set_target_properties(${target} PROPERTIES UNITY_BUILD ON UNITY_BUILD_BATCH_SIZE 8)
  endif()
endfunction()

# commgrad_add_library(<name> SOURCES ... [DEPS ...] [PCH] [NO_UNITY])
#   One layer of the library: a shared library commgrad::<name without prefix>,
#   exported and installed, in unity batches (commgrad_unity_build). NO_UNITY
#   keeps one object per file (the shm engine, whose inlining was measured
#   file by file).
function(commgrad_add_library name)
  cmake_parse_arguments(ARG "PCH;NO_UNITY" "" "SOURCES;DEPS" ${ARGN})
  add_library(${name} SHARED ${ARG_SOURCES})
  if(NOT ARG_NO_UNITY)
    commgrad_unity_build(${name})
  endif()
  add_library(commgrad::${name} ALIAS ${name})
  target_include_directories(${name} PUBLIC
    $<BUILD_INTERFACE:${PROJECT_SOURCE_DIR}/include>
    $<BUILD_INTERFACE:${PROJECT_BINARY_DIR}/include>
    $<INSTALL_INTERFACE:${CMAKE_INSTALL_INCLUDEDIR}>)
  # Users of the installed package compile with at least this standard.
  target_compile_features(${name} PUBLIC cxx_std_${COMMGRAD_CXX_STANDARD})
  # Installed layers find each other next to themselves (RUNPATH is not
  # inherited by a program's transitive dependencies).
  set_target_properties(${name} PROPERTIES INSTALL_RPATH "$ORIGIN;${COMMGRAD_TORCH_LIB_DIR}")
  target_link_libraries(${name} PUBLIC ${ARG_DEPS} ${TORCH_LIBRARIES} Threads::Threads)
  # Programs linked against a layer need the wheel's CUDA libraries found too.
  target_link_options(${name} INTERFACE ${COMMGRAD_TORCH_LINK_OPTIONS})
  if(ARG_PCH)
    commgrad_configure_target(${name} PCH)
  else()
    commgrad_configure_target(${name})
  endif()
  set_property(GLOBAL APPEND PROPERTY COMMGRAD_LAYER_TARGETS ${name})
  install(TARGETS ${name} EXPORT commgradTargets
          LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
          ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR})
endfunction()
