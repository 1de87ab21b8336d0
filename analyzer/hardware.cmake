# dc_hardware: hardware profiles (checked-in data in hardware_profiles.json, embedded at configure
# time) and roofline cost estimates for programs never run here. Depends on the CostModel header
# only, never on dc_analyzer's sources. Included from analyzer/CMakeLists.txt.
file(READ ${CMAKE_CURRENT_SOURCE_DIR}/hardware_profiles.json DC_HARDWARE_PROFILES_JSON)
configure_file(hardware_profiles.cc.in ${CMAKE_CURRENT_BINARY_DIR}/hardware_profiles.cc @ONLY)
set_property(DIRECTORY APPEND PROPERTY CMAKE_CONFIGURE_DEPENDS hardware_profiles.json)

add_library(dc_hardware STATIC
  hardware.cc estimate.cc ${CMAKE_CURRENT_BINARY_DIR}/hardware_profiles.cc)
target_link_libraries(dc_hardware PUBLIC dc_schemas PRIVATE nlohmann_json::nlohmann_json dc_warnings)
set_target_properties(dc_hardware PROPERTIES POSITION_INDEPENDENT_CODE ON)

dc_add_test(hardware_test SOURCES hardware_test.cc estimate_test.cc LIBS dc_hardware dc_models)
