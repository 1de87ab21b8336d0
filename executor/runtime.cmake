# The schedule interpreter, communicators and launcher (included from executor/CMakeLists.txt).
add_library(dc_executor STATIC backend.cc comm.cc device_memory.cc executor.cc launch.cc session.cc)
target_link_libraries(dc_executor PUBLIC dc_schemas dc_cpu_kernels dc_models dc_collector gloo
                      Threads::Threads PRIVATE dc_warnings)

dc_add_test(executor_test SOURCES executor_test.cc LIBS dc_executor dc_rewriter)
