// build_config.cpp — flare_build_config(): what this library was built with, as CMake recorded it in the
// generated header flare_build_config.h (src/CMakeLists.txt). Nothing is probed at run time here.
#include "flare/flare.h"
#include "flare_build_config.h"

extern "C" FLARE_API const char* flare_build_config(void) { return FLARE_BUILD_CONFIG; }
