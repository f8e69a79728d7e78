// k3/dplr.hpp — DPLR / IPLR linear-attention state updates (fla's convention):
//   S_t = (Diag(exp gk_t) + b_t a_t^T) S_{t-1} + k_t v_t^T,   o_t = S_t^T (scale q_t)
// recurrent and chunked forms with backward, KDA expressed as DPLR, segment transfer maps,
// and context parallelism on threads and over a Communicator.
#pragma once
#include "k3/dplr/common.hpp"
#include "k3/dplr/serial.hpp"
#include "k3/dplr/chunked.hpp"
#include "k3/dplr/iplr.hpp"
#include "k3/dplr/maps.hpp"
#include "k3/dplr/kda_map.hpp"
#include "k3/dplr/context_parallel.hpp"
