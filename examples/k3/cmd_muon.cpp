// k3 muon — Muon's Newton–Schulz orthogonalisation (NS5) of a matrix or a stack of matrices,
// per head, and distributed as P2P Muon under mpirun.
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "cli.hpp"
#include "k3/backend/cpu/simd.hpp"
#include "k3/optim.hpp"
#if defined(K3_CLI_HAS_MPI)
#include "k3/comm/mpi.hpp"
#endif

namespace {

using k3::index_t;
namespace optim = k3::optim;

struct request {
  optim::newton_schulz_options opt;
  int threads = 0;
  bool distributed = false;
};

// g as a stack [M, A, B] (a matrix is a stack of one).
struct stack_shape {
  index_t M = 1, A = 0, B = 0;
  bool matrix = true;
};

stack_shape shape_of(k3::io::npy_array const& g) {
  k3::cli::check(g.rank() == 2 || g.rank() == 3, k3::error_kind::shape, [&] {
    return "argument 'g': expected a matrix [A, B] or a stack [M, A, B], got shape " + k3::format_shape(g.shape());
  });
  stack_shape s;
  s.matrix = g.rank() == 2;
  s.M = s.matrix ? 1 : g.shape()[0];
  s.A = g.shape()[g.rank() - 2];
  s.B = g.shape()[g.rank() - 1];
  return s;
}

template <class T>
void write_o(k3::cli::args const& args, stack_shape const& s, T* data) {
  if (s.matrix)
    args.save("o", k3::tensor_view<T, 2>(data, {s.A, s.B}));
  else
    args.save("o", k3::tensor_view<T, 3>(data, {s.M, s.A, s.B}));
}

template <class T>
int run_local(k3::cli::args const& args, k3::io::npy_array& g, stack_shape const& s, request const& rq) {
  std::vector<T> o(static_cast<std::size_t>(g.size()));
  k3::cpu::threads<> backend(rq.threads);
  T const* gp = static_cast<T const*>(g.data());
  optim::newton_schulz(backend, optim::newton_schulz_args<T, 3>{{gp, {s.M, s.A, s.B}}, {o.data(), {s.M, s.A, s.B}}}, rq.opt);
  write_o(args, s, o.data());
  std::printf("orthogonalised %lld matrices [%lld, %lld] (%lld heads, %d steps)\n", static_cast<long long>(s.M),
              static_cast<long long>(s.A), static_cast<long long>(s.B), static_cast<long long>(rq.opt.heads), rq.opt.steps);
  return 0;
}

#if defined(K3_CLI_HAS_MPI)
template <class T>
int run_distributed(k3::cli::args const& args, k3::io::npy_array& g, stack_shape const& s, request const& rq) {
  k3::mpi_session session(nullptr, nullptr);
  k3::mpi_communicator comm;
  int const me = comm.rank(), N = comm.size();
  std::vector<optim::matrix_shape> shapes(static_cast<std::size_t>(s.M), optim::matrix_shape{s.A, s.B, rq.opt.heads});
  optim::p2p_plan const plan = optim::make_p2p_plan(shapes, N, rq.opt.steps);
  index_t const E = s.A * s.B;
  optim::shard_range const mine = optim::shard_of(E, me, N);
  // This rank's shard of every matrix; the file's whole tensor is dropped before the exchange.
  std::vector<T> g_shard(static_cast<std::size_t>(s.M * mine.size())), o_shard(g_shard.size());
  T const* gp = static_cast<T const*>(g.data());
  for (index_t j = 0; j < s.M; ++j)
    std::copy(gp + j * E + mine.begin, gp + j * E + mine.end, g_shard.begin() + j * mine.size());
  g = k3::io::npy_array();
  std::vector<k3::tensor_view<T const, 1>> gin;
  std::vector<k3::tensor_view<T, 1>> oout;
  for (index_t j = 0; j < s.M; ++j) {
    gin.emplace_back(g_shard.data() + j * mine.size(), k3::array<index_t, 1>{mine.size()});
    oout.emplace_back(o_shard.data() + j * mine.size(), k3::array<index_t, 1>{mine.size()});
  }
  k3::cpu::threads<> backend(rq.threads);
  optim::p2p_stats const st = optim::p2p_newton_schulz(
      backend, optim::p2p_newton_schulz_args<k3::mpi_communicator, T>{comm, plan, shapes, gin, oout}, rq.opt);
  // Rank 0 assembles o to write it (outside the optimizer step: not in recv_bytes).
  constexpr int gather_tag = 0x7102;
  if (me == 0) {
    std::vector<T> o(static_cast<std::size_t>(s.M * E));
    for (int r = 0; r < N; ++r) {
      optim::shard_range const sh = optim::shard_of(E, r, N);
      std::vector<T> part(static_cast<std::size_t>(s.M * sh.size()));
      if (r == 0)
        part = o_shard;
      else if (!part.empty())
        comm.recv(k3::wire_view(part.data(), static_cast<index_t>(part.size())), r, gather_tag);
      for (index_t j = 0; j < s.M; ++j)
        std::copy(part.begin() + j * sh.size(), part.begin() + (j + 1) * sh.size(), o.begin() + j * E + sh.begin);
    }
    write_o(args, s, o.data());
  } else if (!o_shard.empty()) {
    comm.send(k3::wire_view(static_cast<T const*>(o_shard.data()), static_cast<index_t>(o_shard.size())), 0, gather_tag);
  }
  std::string owned;
  for (index_t j : plan.owned(me)) owned += (owned.empty() ? "" : ", ") + std::to_string(j);
  std::printf("{\"rank\": %d, \"recv_bytes\": %lld, \"owned\": [%s]}\n", me, static_cast<long long>(st.recv_bytes), owned.c_str());
  std::fflush(stdout);
  return 0;
}
#endif

template <class T>
int run_typed(k3::cli::args const& args, k3::io::npy_array& g, stack_shape const& s, request const& rq) {
  if (rq.distributed) {
#if defined(K3_CLI_HAS_MPI)
    return run_distributed<T>(args, g, s, rq);
#else
    throw k3::cli::usage_error("--distributed needs MPI, and this k3 was built without it");
#endif
  }
  return run_local<T>(args, g, s, rq);
}

int run_muon(k3::cli::args& args) {
  request rq;
  rq.opt.steps = static_cast<int>(args.integer_in("steps", 5, 1, 1000));
  rq.opt.heads = args.integer_in("heads", 1, 1, index_t(1) << 40);
  rq.opt.scale = args.choice("scale", {"none", "moonlight"}) == "moonlight" ? optim::muon_scale::moonlight : optim::muon_scale::none;
  rq.threads = args.threads(0);
  rq.distributed = args.flag("distributed");
  k3::io::npy_array g = args.load("g");
  stack_shape const s = shape_of(g);
  k3::cli::check(s.A % rq.opt.heads == 0, k3::error_kind::shape, [&] {
    return "option '--heads': " + std::to_string(rq.opt.heads) + " heads do not divide the A = " + std::to_string(s.A) + " rows of g " +
           k3::format_shape(g.shape());
  });
  switch (g.type()) {
    case k3::io::dtype::float32: return run_typed<float>(args, g, s, rq);
    case k3::io::dtype::float64: return run_typed<double>(args, g, s, rq);
    case k3::io::dtype::bfloat16:
    case k3::io::dtype::uint16: return run_typed<k3::bfloat16>(args, g, s, rq);
    default:
      throw k3::error(k3::error_kind::dtype, "argument 'g': expected a float32, float64 or bfloat16 array, got " + std::string(k3::io::dtype_name(g.type())));
  }
}

k3::cli::registrar reg({"muon", "Muon's Newton-Schulz orthogonalisation (NS5), per head, and P2P Muon under mpirun",
                        "Reads <in>/g.npy, a matrix [A, B] or a stack [M, A, B] (float32, float64, or bfloat16 as '<u2'),\n"
                        "and writes <out>/o.npy of the same shape and dtype: NS5 of each matrix with (a, b, c) =\n"
                        "(3.4445, -4.7750, 2.0315), X / (||X||_F + 1e-7), transposed internally when A > B. It runs in\n"
                        "float64 for float64 input and in float32 otherwise. --heads H cuts each matrix into H row blocks\n"
                        "of A/H rows, each its own iteration (Per-Head Muon); --scale moonlight multiplies the result by\n"
                        "0.2 * sqrt(max(A, B)) of the whole matrix.\n"
                        "NaN or Inf: a matrix (with --heads, a head block) holding a NaN or an infinity comes out as all\n"
                        "NaN; every other matrix and head is computed as if it were absent.\n"
                        "--distributed (under mpirun): every rank reads the same g.npy, keeps only its shard of each\n"
                        "matrix (elements [E*r/N, E*(r+1)/N) of the flattened matrix), and runs the P2P plan: each matrix\n"
                        "has one owner (balanced by NS5 FLOPs) that receives the other shards point to point,\n"
                        "orthogonalises it and sends each rank its shard back. Rank 0 then collects o and writes it (that\n"
                        "collection is not counted), and every rank prints one JSON line\n"
                        "{\"rank\": r, \"recv_bytes\": n, \"owned\": [matrix indices]}, recv_bytes being the payload bytes\n"
                        "this rank received from other ranks in the plan. The result equals the single-process one bit for bit.",
                        k3::cli::io_options({{"steps", true, "Newton-Schulz steps in [1, 1000] (default 5)"},
                                             {"heads", true, "row blocks per matrix, must divide A (default 1)"},
                                             {"scale", true, "none|moonlight (default none)"},
                                             {"threads", true, "worker threads (default: all)"},
                                             {"distributed", false, "P2P Muon over MPI (run under mpirun)"}}),
                        true, run_muon});

}  // namespace
