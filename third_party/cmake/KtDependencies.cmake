# Finds the optional external packages (Debian's -dev packages) and defines the KT_WITH_*
# options: each defaults to ON when its package is found. Turning one ON that is missing is
# an error; turning all OFF gives the embedded build (portable kernels, one rank).
#
# Packages: OpenBLAS (libopenblas-dev, pkg-config "openblas"), libnuma (libnuma-dev, "numa"),
# UCX (libucx-dev, "ucx"), CUDA (the option is on when the CUDA Toolkit is found; the library
# loads the driver at run time and links nothing of CUDA).

find_package(PkgConfig QUIET)

macro(kt_probe_pkgconfig var module)
  set(${var}_FOUND FALSE)
  if(PKG_CONFIG_FOUND)
    pkg_check_modules(${var} QUIET IMPORTED_TARGET GLOBAL ${module})
  endif()
endmacro()

kt_probe_pkgconfig(kt_openblas openblas)
kt_probe_pkgconfig(kt_numa numa)
kt_probe_pkgconfig(kt_ucx ucx)
find_package(CUDAToolkit QUIET)

option(KT_WITH_OPENBLAS "Use OpenBLAS sgemm for f32 matmuls" ${kt_openblas_FOUND})
option(KT_WITH_NUMA "Bind memory to NUMA nodes with libnuma" ${kt_numa_FOUND})
option(KT_WITH_UCX "Build the UCX communicator" ${kt_ucx_FOUND})
option(KT_WITH_CUDA "Build the CUDA path" ${CUDAToolkit_FOUND})

foreach(pair "OPENBLAS;kt_openblas;libopenblas-dev" "NUMA;kt_numa;libnuma-dev"
             "UCX;kt_ucx;libucx-dev")
  list(GET pair 0 name)
  list(GET pair 1 var)
  list(GET pair 2 pkg)
  if(KT_WITH_${name} AND NOT ${var}_FOUND)
    message(FATAL_ERROR "KT_WITH_${name}=ON but the package was not found (apt-get install ${pkg})")
  endif()
endforeach()
if(KT_WITH_CUDA AND NOT CUDAToolkit_FOUND)
  message(FATAL_ERROR "KT_WITH_CUDA=ON but the CUDA Toolkit was not found")
endif()

# For kt.pc: the pkg-config modules of the backends (each brings its own paths, so kt.pc holds
# none of this machine's) and the system libraries. libkt is static, so a consumer links them
# too: they go in Requires/Libs, not the .private fields.
set(KT_PC_REQUIRES "")
set(KT_PC_LIBS "")

function(kt_link_backends target)
  set(pc_requires "")
  set(pc_libs "")
  if(KT_WITH_OPENBLAS)
    target_compile_definitions(${target} PRIVATE KT_HAVE_OPENBLAS=1)
    target_link_libraries(${target} PRIVATE PkgConfig::kt_openblas)
    list(APPEND pc_requires openblas)
  endif()
  if(KT_WITH_NUMA)
    target_compile_definitions(${target} PRIVATE KT_HAVE_NUMA=1)
    target_link_libraries(${target} PRIVATE PkgConfig::kt_numa)
    list(APPEND pc_requires numa)
  endif()
  if(KT_WITH_UCX)
    target_compile_definitions(${target} PRIVATE KT_HAVE_UCX=1)
    target_link_libraries(${target} PRIVATE PkgConfig::kt_ucx)
    list(APPEND pc_requires ucx)
  endif()
  if(KT_WITH_CUDA)
    target_compile_definitions(${target} PRIVATE KT_HAVE_CUDA=1)
    target_link_libraries(${target} PRIVATE ${CMAKE_DL_LIBS})
    if(CMAKE_DL_LIBS)
      list(APPEND pc_libs "-l${CMAKE_DL_LIBS}")
    endif()
  endif()
  list(APPEND pc_libs -lpthread -lm)
  list(JOIN pc_requires ", " pc_requires)
  list(JOIN pc_libs " " pc_libs)
  set(KT_PC_REQUIRES "${pc_requires}" PARENT_SCOPE)
  set(KT_PC_LIBS "${pc_libs}" PARENT_SCOPE)
endfunction()
