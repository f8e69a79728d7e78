// k3 kda — KDA forward (and optionally backward) on .npy files.
//   in:  q k v g beta [h0] [cu_seqlens]  (+ do [dht] with --backward)
//   out: o ht                            (+ dq dk dv dg dbeta dh0 with --backward)
// float32/float64 inputs compute in their dtype (states too); bfloat16 inputs compute in float32
// with float32 states and write o and the gradients as bfloat16.
#include <cstdio>
#include <optional>
#include <string>
#include <vector>

#include "cli.hpp"
#include "k3/kda.hpp"

namespace {

using k3::index_t;

// T: the storage type of q k v g beta o and their gradients; S: the state type (h0 ht dht dh0),
// float for float32 and bfloat16 inputs, double for float64.
template <class T, class S = k3::accumulation_t<T>>
int run_typed(k3::cli::args& args, k3::kda::options opt) {
  auto q = args.load("q"), k = args.load("k"), v = args.load("v"), g = args.load("g"), beta = args.load("beta");
  auto h0 = args.load_optional("h0");
  bool const backward = args.flag("backward");
  auto qv = q.view<T, 4>("q");
  auto vv = v.view<T, 4>("v");
  index_t const B = qv.extent(0), T_ = qv.extent(1), K = qv.extent(3), HV = vv.extent(2), V = vv.extent(3);
  // The outputs are sized from q's and v's extents: check them (and cu_seqlens) before
  // allocating, so that inconsistent shapes give the shape error, not a huge allocation.
  k3::kda::forward_args<T, S> shape_of;
  shape_of.q = qv;
  shape_of.v = vv;
  index_t const N = k3::kda::state_shape(shape_of, opt)[0];
  std::vector<T> o(std::size_t(k3::cli::output_elements("o", {B, T_, HV, V})));
  std::vector<S> ht(std::size_t(k3::cli::output_elements("ht", {N, HV, K, V})));
  k3::cli::output_elements("one state", {HV, K, V});  // per-sequence scratch, even when N = 0
  k3::kda::forward_args<T, S> a;
  a.q = qv;
  a.k = k.view<T, 4>("k");
  a.v = vv;
  a.g = g.view<T, 4>("g");
  a.beta = beta.view<T, 3>("beta");
  a.o = k3::host_view(o.data(), B, T_, HV, V);
  if (h0) a.h0 = h0->view<S, 4>("h0");
  a.ht = k3::host_view(ht.data(), std::max<index_t>(N, 0), HV, K, V);
  // With --backward in the chunked form the forward also keeps what the backward needs per chunk
  // (forward_args::saved), so the backward does not recompute the state recurrence; the
  // gradients are the same bit for bit.
  std::vector<S> saved;
  if (backward && opt.mode != k3::kda::algorithm::recurrent) {
    auto const sh = k3::kda::saved_shape(a, opt);
    saved.resize(std::size_t(sh[0] * sh[1] * sh[2]));
    a.saved = k3::host_view(saved.data(), sh[0], sh[1], sh[2]);
  }
  k3::cpu::threads<> be(args.threads(0));
  k3::kda::forward(be, a, opt);
  args.save("o", a.o);
  args.save("ht", a.ht);
  if (!backward) return 0;
  auto d_o = args.load("do");
  auto dht = args.load_optional("dht");
  std::vector<T> dq(std::size_t(qv.size())), dk(dq.size()), dv(std::size_t(vv.size())), dg(std::size_t(a.g.size())),
      dbeta(std::size_t(a.beta.size()));
  std::vector<S> dh0(ht.size());
  k3::kda::backward_args<T, S> b;
  b.q = a.q;
  b.k = a.k;
  b.v = a.v;
  b.g = a.g;
  b.beta = a.beta;
  b.h0 = a.h0;
  b.d_o = d_o.view<T, 4>("do");
  if (dht) b.dht = dht->view<S, 4>("dht");
  b.dq = k3::host_view(dq.data(), B, T_, qv.extent(2), K);
  b.dk = k3::host_view(dk.data(), B, T_, qv.extent(2), K);
  b.dv = k3::host_view(dv.data(), B, T_, HV, V);
  b.dg = k3::host_view(dg.data(), B, T_, HV, K);
  b.dbeta = k3::host_view(dbeta.data(), B, T_, HV);
  b.dh0 = k3::host_view(dh0.data(), std::max<index_t>(N, 0), HV, K, V);
  b.saved = a.saved;
  k3::kda::backward(be, b, opt);
  args.save("dq", b.dq);
  args.save("dk", b.dk);
  args.save("dv", b.dv);
  args.save("dg", b.dg);
  args.save("dbeta", b.dbeta);
  args.save("dh0", b.dh0);
  return 0;
}

int run_kda_body(k3::cli::args& args) {
  args.threads(0);  // a bad --threads is reported before any input is read
  k3::kda::options opt;
  std::string const mode = args.choice("mode", {"automatic", "chunk", "recurrent"});
  opt.mode = mode == "chunk" ? k3::kda::algorithm::chunk : mode == "recurrent" ? k3::kda::algorithm::recurrent : k3::kda::algorithm::automatic;
  if (args.has("scale")) opt.scale = args.number("scale", 0);
  if (args.has("gate-lower-bound")) opt.gate_lower_bound = args.number("gate-lower-bound", -5);
  auto q = args.load("q");
  // bfloat16 arrive as numpy's ml_dtypes '|V2' or as PyTorch's .view(torch.uint16) dump '<u2'.
  auto kind = [](k3::io::dtype x) { return x == k3::io::dtype::uint16 ? k3::io::dtype::bfloat16 : x; };
  k3::io::dtype const t = kind(q.type());
  if (t != k3::io::dtype::float32 && t != k3::io::dtype::float64 && t != k3::io::dtype::bfloat16)
    throw k3::error(k3::error_kind::dtype, std::string("argument 'q': expected dtype float32, float64 or bfloat16, got ") + k3::io::dtype_name(q.type()));
  // The states are float32 for float32 and bfloat16 inputs (as in fla), float64 for float64.
  k3::io::dtype const st = t == k3::io::dtype::float64 ? t : k3::io::dtype::float32;
  std::vector<std::string> names = {"k", "v", "g", "beta"};
  if (args.flag("backward")) names.push_back("do");
  // dht.npy is read only with --backward (like do.npy): a stale one is otherwise ignored.
  std::vector<std::string> states = {"h0"};
  if (args.flag("backward")) states.push_back("dht");
  for (auto const& extra : states)
    if (auto x = args.load_optional(extra)) {
      if (x->type() != st)
        throw k3::error(k3::error_kind::dtype, "argument '" + extra + "': expected dtype " + k3::io::dtype_name(st) + " (the state type for q of dtype " +
                        k3::io::dtype_name(t) + "), got " + k3::io::dtype_name(x->type()));
    }
  for (auto const& n : names) {
    auto x = args.load(n);
    if (kind(x.type()) != t)
      throw k3::error(k3::error_kind::dtype, "argument '" + n + "': expected dtype " + k3::io::dtype_name(t) + " (the dtype of q), got " +
                      k3::io::dtype_name(x.type()));
  }
  std::vector<std::int64_t> cu;
  if (auto c = args.load_optional("cu_seqlens")) {
    if (c->type() != k3::io::dtype::int32 && c->type() != k3::io::dtype::int64)
      throw k3::error(k3::error_kind::dtype, std::string("argument 'cu_seqlens': expected dtype int32 or int64, got ") + k3::io::dtype_name(c->type()));
    if (c->rank() != 1) throw k3::error(k3::error_kind::shape, "argument 'cu_seqlens': expected rank 1, got shape " + k3::format_shape(c->shape()));
    for (index_t i = 0; i < c->size(); ++i) cu.push_back(c->as_int(i));
    opt.cu_seqlens = cu;
  }
  if (t == k3::io::dtype::bfloat16) return run_typed<k3::bfloat16>(args, opt);
  return t == k3::io::dtype::float32 ? run_typed<float>(args, opt) : run_typed<double>(args, opt);
}

int run_kda(k3::cli::args& args) {
  return k3::cli::with_option_spellings({{"gate_lower_bound", "gate-lower-bound"}, {"scale", "scale"}}, [&] { return run_kda_body(args); });
}

k3::cli::registrar reg({"kda",
                        "Kimi Delta Attention forward (and backward) on .npy files",
                        "Reads q k v g beta [h0] [cu_seqlens] from --in (q, k [B,T,H,K]; v [B,T,HV,V]; g [B,T,HV,K];\n"
                        "beta [B,T,HV]; h0 [N,HV,K,V]; cu_seqlens int32/int64 [N+1] with B = 1) and writes o, ht.\n"
                        "With --backward also reads do [dht] and writes dq dk dv dg dbeta dh0.\n"
                        "g and beta are used as given (already gated). float32 or float64 inputs compute in their dtype;\n"
                        "bfloat16 inputs ('|V2' or PyTorch's '<u2' dump) compute in float32 with float32 states h0 ht dht\n"
                        "dh0 and write o and the input gradients as bfloat16 ('<u2').",
                        k3::cli::io_options({{"mode", true,
                                              "automatic (default: the recurrence for a forward alone, the chunked form with --backward), "
                                              "chunk or recurrent"},
                                             {"scale", true, "query scale (default K^-1/2)"},
                                             {"gate-lower-bound", true, "promise g >= this bound (in [-5, 0)): dense diagonal tiles"},
                                             {"backward", false, "also compute the gradients from do.npy [dht.npy]"},
                                             {"threads", true, "worker threads (default 0: one per hardware thread); results do not depend on it"}}),
                        true, run_kda});

}  // namespace
