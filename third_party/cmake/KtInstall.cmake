# Install rules: libkt.a, the public headers, kt.pc and the CMake package (find_package(kt)
# giving kt::kt).
include(CMakePackageConfigHelpers)

install(TARGETS kt EXPORT ktTargets ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR})
install(DIRECTORY include/kt DESTINATION ${CMAKE_INSTALL_INCLUDEDIR} FILES_MATCHING PATTERN "*.h")

# The library is static only, so its dependencies go in Libs rather than Libs.private: a
# consumer that forgets --static still links.
file(RELATIVE_PATH KT_PC_PREFIX_FROM_PCDIR "/p/${CMAKE_INSTALL_LIBDIR}/pkgconfig" "/p")
configure_file(cmake/kt.pc.in ${CMAKE_CURRENT_BINARY_DIR}/kt.pc @ONLY)
install(FILES ${CMAKE_CURRENT_BINARY_DIR}/kt.pc DESTINATION ${CMAKE_INSTALL_LIBDIR}/pkgconfig)

install(EXPORT ktTargets NAMESPACE kt:: DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/kt)
configure_package_config_file(cmake/ktConfig.cmake.in
  ${CMAKE_CURRENT_BINARY_DIR}/ktConfig.cmake
  INSTALL_DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/kt)
write_basic_package_version_file(${CMAKE_CURRENT_BINARY_DIR}/ktConfigVersion.cmake
  COMPATIBILITY SameMajorVersion)
install(FILES ${CMAKE_CURRENT_BINARY_DIR}/ktConfig.cmake
              ${CMAKE_CURRENT_BINARY_DIR}/ktConfigVersion.cmake
        DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/kt)
