# Sourced by the build scripts. ccache keys an object by the compile command; with debug info
# (-g) it also keys it by the working directory unless told not to. The build directories of one
# checkout (build/, build-pip/ for `pip install .`) compile the same sources with the same flags,
# so let them share objects: paths relative to the checkout, the directory not hashed.
# A user's own ccache settings in the environment win.
export CCACHE_BASEDIR=${CCACHE_BASEDIR:-$PWD}
export CCACHE_NOHASHDIR=${CCACHE_NOHASHDIR:-1}
