# Runs by `cmake -P` from the Install.* test: installs the build into a
# temporary prefix, then
#  1. configures, builds and runs tests/install/consumer, an outside project
#     that finds the package with only CMAKE_PREFIX_PATH pointing at the prefix
#     (the C++ standard and LibTorch come from the package itself);
#  2. runs the installed programs from the prefix with no LD_LIBRARY_PATH:
#     `bin/commgrad-run --version` and `bin/commgrad-run -n 2 bin/tp_autograd_comm`.
set(prefix ${BUILD_DIR}/install-test/prefix)
set(consumer_build ${BUILD_DIR}/install-test/consumer)

# run(<expected substring or ""> <command...>): fails on a non-zero exit or
# when the output lacks the expected text; echoes the output.
function(run expected)
  execute_process(COMMAND ${CMAKE_COMMAND} -E env --unset=LD_LIBRARY_PATH ${ARGN}
                  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  message("${out}${err}")
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "failed (${rc}): ${ARGN}")
  endif()
  if(expected)
    string(FIND "${out}" "${expected}" at)
    if(at EQUAL -1)
      message(FATAL_ERROR "the output of ${ARGN} lacks '${expected}'")
    endif()
  endif()
endfunction()

file(REMOVE_RECURSE ${prefix} ${consumer_build})
run("" ${CMAKE_COMMAND} --install ${BUILD_DIR} --prefix ${prefix})
run("" ${CMAKE_COMMAND} -S ${CONSUMER_DIR} -B ${consumer_build} -G ${GENERATOR}
    -DCMAKE_PREFIX_PATH=${prefix} -DCMAKE_BUILD_TYPE=Release)
run("" ${CMAKE_COMMAND} --build ${consumer_build})
run("consumer: x.grad = tensor([1., 1.])" ${consumer_build}/consumer)
run("commgrad ${VERSION} (LibTorch ${TORCH_VERSION}, C++" ${prefix}/bin/commgrad-run --version)
run("[0] x.grad = tensor([2., 2., 2., 2.])" ${prefix}/bin/commgrad-run -n 2 --timeout 120 ${prefix}/bin/tp_autograd_comm)
message("install test: OK")
