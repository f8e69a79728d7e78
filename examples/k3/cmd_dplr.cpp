// k3 dplr — DPLR forward (and backward) on .npy files:
//   in:  q k v a b gk (.npy, float32, float64 or bfloat16, [B,T,H,K] / v [B,T,H,V]), optional h0
//        [N,H,K,V] (float64 for float64 inputs, else float32) and cu_seqlens (int32 or
//        int64, [N+1], B = 1); with --backward also do [B,T,H,V] and optional dht [N,H,K,V]
//   out: o ht; with --backward also dq dk dv da db dgk dh0
#if defined(__GNUC__) && !defined(__clang__) && __GNUC__ < 13
#pragma GCC diagnostic ignored "-Wuninitialized"  // GCC bug 105593 in AVX-512 intrinsics via Eigen
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#include <cstdio>
#include <optional>
#include <string>

#include "cli.hpp"
#include "k3/core/tensor.hpp"
#include "k3/dplr.hpp"

namespace {

using k3::index_t;

bool is_bf16(k3::io::npy_array const& x) { return x.type() == k3::io::dtype::bfloat16 || x.type() == k3::io::dtype::uint16; }

// bfloat16 inputs run in float32 (the DPLR kernels take float or double): a float32 copy; any
// other dtype is passed through for the typed views to check.
k3::io::npy_array widen(k3::io::npy_array x) {
  if (!is_bf16(x)) return x;
  k3::io::npy_array f(k3::io::dtype::float32, x.shape());
  auto const* src = static_cast<std::uint16_t const*>(static_cast<k3::io::npy_array const&>(x).data());
  auto* dst = static_cast<float*>(f.data());
  for (index_t i = 0; i < x.size(); ++i) dst[i] = float(k3::bfloat16::from_bits(src[i]));
  return f;
}

template <class T>
int run_typed(k3::cli::args& args, k3::io::npy_array const& q, bool bf16_io = false) {
  using S = k3::dplr::state_t<T>;
  auto load = [&](char const* name) -> k3::io::npy_array {
    auto x = args.load(name);
    if (bf16_io && !is_bf16(x))
      throw k3::error(k3::error_kind::dtype, std::string("argument '") + name + "': expected dtype bfloat16 (the dtype of q), got " + k3::io::dtype_name(x.type()));
    return bf16_io ? widen(std::move(x)) : x;
  };
  // Outputs in the inputs' storage type: bfloat16 ('<u2') for bfloat16 inputs.
  auto save = [&](char const* name, k3::tensor_view<T, 4> v) {
    if (!bf16_io) return args.save(name, v);
    std::vector<k3::bfloat16> r(static_cast<std::size_t>(v.size()));
    T const* p = v.data_handle();
    for (std::size_t i = 0; i < r.size(); ++i) r[i] = k3::bfloat16(p[i]);
    args.save(name, k3::host_view(r.data(), v.extent(0), v.extent(1), v.extent(2), v.extent(3)));
  };
  k3::io::npy_array k = load("k"), v = load("v"), a = load("a"), b = load("b"), gk = load("gk");
  auto h0 = args.load_optional("h0");
  auto cu = args.load_optional("cu_seqlens");
  k3::dplr::forward_args<T> in{q.view<T, 4>("q"), k.view<T, 4>("k"), v.view<T, 4>("v"), a.view<T, 4>("a"), b.view<T, 4>("b"), gk.view<T, 4>("gk")};
  if (h0) in.h0 = h0->view<S, 4>("h0");
  k3::dplr::options opt;
  if (args.has("scale")) opt.scale = args.number("scale", 0);
  opt.chunk_size = args.integer("chunk-size", 64);
  opt.long_sequence = args.choice("long-sequence", {"value-split", "segment-maps"}) == "segment-maps" ? k3::dplr::sequence_split::segment_maps
                                                                                                       : k3::dplr::sequence_split::value_split;
  if (cu) {
    // An empty array would read as "no cu_seqlens" (a null view) further down.
    if (cu->rank() == 1 && cu->shape()[0] == 0) throw k3::error(k3::error_kind::shape, "argument 'cu_seqlens': needs at least one offset (N+1 entries), got shape [0]");
    if (cu->type() == k3::io::dtype::int32) opt.cu_seqlens = cu->view<std::int32_t, 1>("cu_seqlens");
    else opt.cu_seqlens = cu->view<std::int64_t, 1>("cu_seqlens");
  }
  // "chunked" is the earlier spelling of "chunk", still accepted.
  std::string const mode = args.choice("mode", {"chunk", "recurrent", "chunked"});
  opt.mode = mode == "recurrent" ? k3::dplr::algorithm::recurrent : k3::dplr::algorithm::chunk;
  k3::cpu::threads<> th(args.threads(1));
  index_t B = in.q.extent(0), T_ = in.q.extent(1), H = in.q.extent(2), K = in.q.extent(3), V = in.v.extent(3);
  // Every input shape (and cu_seqlens, h0) checked before the outputs are sized from them.
  index_t const N = k3::dplr::state_shape(in, opt)[0];
  k3::cli::output_elements("o", {B, T_, H, V});
  k3::cli::output_elements("ht", {N, H, K, V});
  k3::cli::output_elements("one state", {H, K, V});  // per-sequence scratch, even when N = 0
  k3::tensor<T, 4> o({B, T_, H, V});
  k3::tensor<S, 4> ht({N, H, K, V});
  in.o = o.view();
  in.ht = ht.view();
  k3::dplr::forward(th, in, opt);
  save("o", o.view());
  args.save("ht", ht.view());
  if (args.flag("backward")) {
    k3::io::npy_array dO = load("do");
    auto dht = args.load_optional("dht");
    k3::tensor<T, 4> dq({B, T_, H, K}), dk({B, T_, H, K}), dv({B, T_, H, V}), da({B, T_, H, K}), db({B, T_, H, K}), dg({B, T_, H, K});
    k3::tensor<S, 4> dh0({N, H, K, V});
    k3::dplr::backward_args<T> g{in.q, in.k, in.v, in.a, in.b, in.gk, in.h0, dO.view<T, 4>("do")};
    if (dht) g.dht = dht->view<S, 4>("dht");
    g.dq = dq.view(), g.dk = dk.view(), g.dv = dv.view(), g.da = da.view(), g.db = db.view(), g.dgk = dg.view(), g.dh0 = dh0.view();
    k3::dplr::backward(th, g, opt);
    save("dq", dq.view());
    save("dk", dk.view());
    save("dv", dv.view());
    save("da", da.view());
    save("db", db.view());
    save("dgk", dg.view());
    args.save("dh0", dh0.view());
  }
  return 0;
}

int run_dplr_body(k3::cli::args& args) {
  args.threads(1);  // a bad --threads is reported before any input is read
  auto q = args.load("q");
  if (q.type() == k3::io::dtype::float32) return run_typed<float>(args, q);
  if (q.type() == k3::io::dtype::float64) return run_typed<double>(args, q);
  // bfloat16 ('|V2', or PyTorch's .view(torch.uint16) dump '<u2'): computed in float32.
  if (is_bf16(q)) return run_typed<float>(args, widen(q), true);
  throw k3::error(k3::error_kind::dtype, std::string("argument 'q': expected dtype float32, float64 or bfloat16, got ") + k3::io::dtype_name(q.type()));
}

int run_dplr(k3::cli::args& args) {
  return k3::cli::with_option_spellings({{"chunk_size", "chunk-size"}, {"scale", "scale"}}, [&] { return run_dplr_body(args); });
}

k3::cli::registrar reg({"dplr", "DPLR state update (forward, --backward for gradients)",
                        "S_t = (Diag(exp gk_t) + b_t a_t^T) S_{t-1} + k_t v_t^T, o_t = S_t^T (scale q_t).\n"
                        "Reads q k v a b gk [B,T,H,K] (v [B,T,H,V]) and optional h0 [N,H,K,V], cu_seqlens [N+1];\n"
                        "writes o ht. --backward also reads do (and optional dht), writes dq dk dv da db dgk dh0.\n"
                        "float32/float64 inputs compute in their dtype; bfloat16 inputs compute in float32 with float32\n"
                        "h0 ht dht dh0 and write o and the input gradients as bfloat16 ('<u2').",
                        k3::cli::io_options({{"scale", true, "query scale (default K^-1/2)"},
                                             {"chunk-size", true, "chunk length of the chunked form (default 64)"},
                                             {"mode", true, "chunk (default; also spelled chunked) or recurrent (token by token)"},
                                             {"threads", true, "threads (default 1; 0 = one per hardware thread)"},
                                             {"long-sequence", true, "value-split (default) or segment-maps: how one sequence uses all threads"},
                                             {"backward", false, "also compute gradients from do (and dht)"}}),
                        true, run_dplr});

}  // namespace
