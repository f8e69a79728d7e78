// k3/core.hpp — the core vocabulary: views, owning tensors, spaces, concepts, errors,
// numeric storage types. Brings no Eigen and no xsimd.
#pragma once
#include "k3/core/array.hpp"
#include "k3/core/concepts.hpp"
#include "k3/core/config.hpp"
#include "k3/core/error.hpp"
#include "k3/core/math.hpp"
#include "k3/core/memory_space.hpp"
#include "k3/core/numeric/bfloat16.hpp"
#include "k3/core/tensor.hpp"
#include "k3/core/tensor_view.hpp"
#include "k3/core/validate.hpp"
#include "k3/version.hpp"
