# Sourced by the build scripts. ccache keys an object by the compile command, including the name
# the compiler was called by, and with debug info (-g) by the working directory too unless told
# not to. The build directories of one checkout (build/, and build-pip/ for `pip install .`)
# compile the same sources with the same flags, so let them share objects: paths relative to the
# checkout, the directory not hashed, and one name for the compiler (CMake's default c++ and cc;
# scikit-build-core would otherwise pass Python's g++ and gcc). Settings already in the
# environment win.
export CCACHE_BASEDIR=${CCACHE_BASEDIR:-$PWD}
export CCACHE_NOHASHDIR=${CCACHE_NOHASHDIR:-1}
export CC=${CC:-cc}
export CXX=${CXX:-c++}
