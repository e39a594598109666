// cute_config.hpp — CuTe options of the sm90 kernels; every sm90 header includes it before any CuTe header.
#pragma once

// Key tiles of 80 or 96 keys need wgmma shapes outside the short list that CuTe
// declares only on request.
#ifndef CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED
#define CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED
#endif
