// k3/attnres.hpp — Attention Residuals (full and block AttnRes) on the CPU backends:
//   mix_forward / mix_backward       one mixing site (k3/attnres/mix.hpp)
//   phase1 / phase2 / block_rinv     two-phase inference (k3/attnres/two_phase.hpp)
//   block_attn_res                   the model-agnostic block driver (k3/attnres/block.hpp)
//   pipeline_cache                   pipeline-parallel block cache (k3/attnres/pipeline.hpp)
// The same calls with device views on k3::cuda::stream_backend: k3/attnres/cuda/backend.cuh.
// Spec: shared/spec/attnres.md.
#pragma once
#include "k3/attnres/mix.hpp"
#include "k3/attnres/two_phase.hpp"
#include "k3/attnres/block.hpp"
#include "k3/attnres/pipeline.hpp"
