# dc-trace's library: timelines over dc traces, nsys exports, PyTorch profiler traces and plans;
# the summary, diff, Perfetto JSON and memory SVG made from them.
find_package(ZLIB REQUIRED)

add_library(dc_trace_tools STATIC report.cc kineto.cc perfetto.cc svg.cc)
target_link_libraries(dc_trace_tools PUBLIC dc_analyzer nlohmann_json::nlohmann_json
                      PRIVATE ZLIB::ZLIB SQLite::SQLite3 dc_warnings)

dc_add_test(trace_tools_test
  SOURCES report_test.cc kineto_test.cc perfetto_test.cc svg_test.cc test_traces.cc
  LIBS dc_trace_tools dc_analyzer dc_collector ZLIB::ZLIB SQLite::SQLite3)
