// k3 attnres — one AttnRes mixing site over .npy files (forward, optionally backward).
//   in:  sources.npy [n, T, d] (float32, float64 or bfloat16), w.npy [d], gain.npy [d],
//        optional partial.npy [T, d] (same dtype as sources), dh.npy [T, d] with --backward
//   out: h.npy [T, d] (the sources' dtype); with --backward also dsources.npy [n, T, d],
//        dw.npy [d], dgain.npy [d] and, when a partial was given, dpartial.npy [T, d]
//        (gradients in float32, float64 for float64 sources)
#include <cstdint>
#include <cstdio>
#include <optional>
#include <string>
#include <vector>

#include "cli.hpp"
#include "k3/attnres.hpp"

namespace {

namespace ar = k3::attnres;

// Element i as a double; '<u2' arrays are bfloat16 bits (how PyTorch bfloat16 tensors are dumped,
// .view(torch.uint16), as k3/io/npy.hpp documents), not integers.
double element(k3::io::npy_array const& a, k3::index_t i) {
  if (a.type() == k3::io::dtype::uint16) return float(k3::bfloat16::from_bits(static_cast<std::uint16_t>(a.as_int(i))));
  return a.as_double(i);
}

template <class C>
std::vector<C> load_vector(k3::io::npy_array const& a, std::string const& name) {
  k3::cli::check(a.rank() == 1, k3::error_kind::shape, [&] {
    return "argument '" + name + "': expected rank 1 ([d]), got shape " + k3::format_shape(a.shape());
  });
  k3::cli::check(a.type() == k3::io::dtype::float32 || a.type() == k3::io::dtype::float64 || a.type() == k3::io::dtype::bfloat16 ||
                          a.type() == k3::io::dtype::uint16, k3::error_kind::dtype,
                      [&] { return "argument '" + name + "': expected a floating-point dtype, got " + k3::io::dtype_name(a.type()); });
  std::vector<C> v(static_cast<std::size_t>(a.size()));
  for (k3::index_t i = 0; i < a.size(); ++i) v[static_cast<std::size_t>(i)] = C(element(a, i));
  return v;
}

template <class S>
int run_typed(k3::cli::args& args, k3::io::npy_array const& src_arr) {
  using C = k3::accumulation_t<S>;
  k3::cpu::threads<> b(args.threads(0));
  auto bank = src_arr.view<S, 3>("sources");
  k3::index_t const T = bank.extent(1), d = bank.extent(2);
  auto part_arr = args.load_optional("partial");
  std::optional<k3::tensor_view<S const, 2>> part;
  if (part_arr) part = part_arr->view<S, 2>("partial");
  auto w = load_vector<C>(args.load("w"), "w");
  auto g = load_vector<C>(args.load("gain"), "gain");
  auto wv = k3::tensor_view<C const, 1>(w.data(), {static_cast<k3::index_t>(w.size())});
  auto gv = k3::tensor_view<C const, 1>(g.data(), {static_cast<k3::index_t>(g.size())});
  ar::options opt;
  opt.eps = args.number("eps", 1e-5);
  // dh is read and checked before anything is written: a bad dh leaves no h.npy behind.
  std::vector<C> dh;
  bool const backward = args.flag("backward");
  if (backward) {
    auto dh_arr = args.load("dh");
    k3::cli::check(dh_arr.rank() == 2 && dh_arr.shape()[0] == T && dh_arr.shape()[1] == d, k3::error_kind::shape, [&] {
      return "argument 'dh': expected shape [" + std::to_string(T) + ", " + std::to_string(d) + "], got " +
             k3::format_shape(dh_arr.shape());
    });
    // Like w and gain: an integer file is not a gradient.
    k3::cli::check(dh_arr.type() == k3::io::dtype::float32 || dh_arr.type() == k3::io::dtype::float64 ||
                            dh_arr.type() == k3::io::dtype::bfloat16 || dh_arr.type() == k3::io::dtype::uint16, k3::error_kind::dtype,
                        [&] { return std::string("argument 'dh': expected a floating-point dtype, got ") + k3::io::dtype_name(dh_arr.type()); });
    dh.resize(static_cast<std::size_t>(T * d));
    for (k3::index_t i = 0; i < T * d; ++i) dh[static_cast<std::size_t>(i)] = C(element(dh_arr, i));
  }
  auto src = part ? ar::make_sources(bank, *part) : ar::make_sources(bank);
  std::vector<S> h(static_cast<std::size_t>(k3::cli::output_elements("h", {T, d})));
  ar::mix_forward(b, ar::mix_forward_args<S, C>{.sources = src, .w = wv, .gain = gv, .h = k3::host_view(h.data(), T, d)}, opt);
  args.save("h", k3::host_view(h.data(), T, d));
  if (backward) {
    k3::index_t const n = bank.extent(0);
    std::vector<C> ds(static_cast<std::size_t>(n * T * d)), dp(static_cast<std::size_t>(T * d)), dw(w.size()), dg(g.size());
    ar::mix_backward(b,
                     ar::mix_backward_args<S, C, C>{.sources = src, .w = wv, .gain = gv, .d_h = k3::tensor_view<C const, 2>(dh.data(), {T, d}),
                                                    .d_sources = ar::make_grads(k3::host_view(ds.data(), n, T, d), k3::host_view(dp.data(), T, d)),
                                                    .d_w = k3::host_view(dw.data(), static_cast<k3::index_t>(dw.size())),
                                                    .d_gain = k3::host_view(dg.data(), static_cast<k3::index_t>(dg.size()))},
                     opt);
    args.save("dsources", k3::host_view(ds.data(), n, T, d));
    if (part) args.save("dpartial", k3::host_view(dp.data(), T, d));
    args.save("dw", k3::host_view(dw.data(), static_cast<k3::index_t>(dw.size())));
    args.save("dgain", k3::host_view(dg.data(), static_cast<k3::index_t>(dg.size())));
  }
  return 0;
}

int run_attnres(k3::cli::args& args) {
  args.threads(0);  // a bad --threads is reported before any input is read
  auto src = args.load("sources");
  switch (src.type()) {
    case k3::io::dtype::float32: return run_typed<float>(args, src);
    case k3::io::dtype::float64: return run_typed<double>(args, src);
    case k3::io::dtype::bfloat16:
    case k3::io::dtype::uint16: return run_typed<k3::bfloat16>(args, src);  // '<u2': PyTorch's bfloat16 dump
    default:
      throw k3::error(k3::error_kind::dtype, std::string("argument 'sources': expected float32, float64 or bfloat16, got ") + k3::io::dtype_name(src.type()));
  }
}

k3::cli::registrar reg({"attnres", "one AttnRes mixing site: h = sum_j softmax_j(rinv_j (g*w).v_j) v_j (and its backward)",
                        "Reads sources.npy [n,T,d] (float32/float64/bfloat16), w.npy [d], gain.npy [d], optional partial.npy [T,d]\n"
                        "(an extra source after the bank rows); writes h.npy [T,d]. With --backward also reads dh.npy [T,d] and\n"
                        "writes dsources.npy, dw.npy, dgain.npy and (with a partial) dpartial.npy. h has the sources' dtype\n"
                        "(bfloat16 as '<u2' bits: .view(ml_dtypes.bfloat16) or .view(torch.bfloat16)); the gradients are float32\n"
                        "(float64 for float64 sources).",
                        k3::cli::io_options({{"backward", false, "also compute the gradients from dh.npy"},
                                             {"eps", true, "the key RMSNorm eps (default 1e-5)"},
                                             {"threads", true, "worker threads (default: all hardware threads)"}}),
                        true, run_attnres});

}  // namespace
