# `cmake --install` puts the commands in bin/, the libraries in lib/dc/, the public headers
# under include/dc/ and a CMake package, so another project can `find_package(dc)` and link
# dc::analyzer, dc::rewriter, ...
include(CMakePackageConfigHelpers)
include(GNUInstallDirs)

set(DC_EXPORTED_LIBRARIES dc_source_root dc_proto dc_schemas_base dc_schemas dc_models dc_weights dc_sqlite_writer
    dc_collector dc_analyzer dc_machine
    dc_rewriter dc_data dc_cpu_kernels dc_tcp_store dc_executor)
if(TARGET dc_trace_tools)
  list(APPEND DC_EXPORTED_LIBRARIES dc_trace_tools)
endif()
foreach(lib ${DC_EXPORTED_LIBRARIES})
  target_include_directories(${lib} INTERFACE $<INSTALL_INTERFACE:${CMAKE_INSTALL_INCLUDEDIR}/dc>)
  string(REPLACE "dc_" "" export_name ${lib})
  set_target_properties(${lib} PROPERTIES EXPORT_NAME ${export_name})
endforeach()
set_target_properties(dc_warnings PROPERTIES EXPORT_NAME warnings)

install(TARGETS ${DC_EXPORTED_LIBRARIES} dc_warnings EXPORT dcTargets
        ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}/dc)
install(DIRECTORY schemas models weights collector machine analyzer tracetools rewriter executor
        DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/dc
        FILES_MATCHING PATTERN "*.h" PATTERN "*_test*" EXCLUDE PATTERN "test_*" EXCLUDE)
install(FILES ${CMAKE_BINARY_DIR}/schemas/program.pb.h ${CMAKE_BINARY_DIR}/schemas/schedule.pb.h
              schemas/program.proto schemas/schedule.proto schemas/trace_schema.sql
        DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/dc/schemas)
install(EXPORT dcTargets NAMESPACE dc:: DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/dc)
configure_package_config_file(${CMAKE_SOURCE_DIR}/cmake/dcConfig.cmake.in
                              ${CMAKE_BINARY_DIR}/dcConfig.cmake
                              INSTALL_DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/dc)
write_basic_package_version_file(${CMAKE_BINARY_DIR}/dcConfigVersion.cmake
                                 COMPATIBILITY SameMinorVersion)
install(FILES ${CMAKE_BINARY_DIR}/dcConfig.cmake ${CMAKE_BINARY_DIR}/dcConfigVersion.cmake
        DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/dc)
