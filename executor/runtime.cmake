# The schedule interpreter and the cpu backend's device, communicators and launcher (included
# from executor/CMakeLists.txt).
# The ranks' TCP rendezvous (executor/tcp_store.h), for Gloo here and NCCL in cuda/.
add_library(dc_tcp_store STATIC tcp_store.cc)
target_link_libraries(dc_tcp_store PUBLIC dc_schemas Threads::Threads PRIVATE dc_warnings)
set_target_properties(dc_tcp_store PROPERTIES POSITION_INDEPENDENT_CODE ON)
dc_add_test(tcp_store_test SOURCES tcp_store_test.cc LIBS dc_tcp_store)

add_library(dc_executor STATIC backend.cc checkpoint.cc comm.cc cpu_device.cc device_memory.cc executor.cc
                               interpreter.cc launch.cc layout.cc session.cc shared_memory.cc tracer.cc)
target_link_libraries(dc_executor PUBLIC dc_schemas dc_cpu_kernels dc_data dc_models dc_weights
                      dc_collector dc_tcp_store gloo Threads::Threads PRIVATE nlohmann_json::nlohmann_json
                      dc_warnings)

dc_add_test(executor_test SOURCES executor_test.cc LIBS dc_executor dc_rewriter)
# The Gloo collectives' results on 2-4 ranks, and no core spent on a rank waiting for its peer.
dc_add_test(comm_test SOURCES comm_test.cc LIBS dc_executor)
# The cpu device's stream threads against its serial order, bit for bit, under shaken timing.
dc_add_test(cpu_device_test SOURCES cpu_device_test.cc LIBS dc_executor dc_rewriter dc_models
            dc_machine)
# Anywhere: what the interpreter derives from a plan (waits, staging, host memory) and refuses.
dc_add_test(layout_test SOURCES layout_test.cc LIBS dc_executor dc_rewriter dc_models dc_machine)

# A run's weights in and out in Hugging Face's format (--init-from, --export, --dump-grads).
add_library(dc_weights_io STATIC weights_io.cc)
target_link_libraries(dc_weights_io PUBLIC dc_executor PRIVATE dc_weights nlohmann_json::nlohmann_json
                      dc_warnings)
