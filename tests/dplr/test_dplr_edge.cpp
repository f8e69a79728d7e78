// Adversarial API checks (round 4): outputs (o, ht, gradients, dh0, segment maps, applied
// states) overlapping an input or a state must be rejected with a k3::error naming both.
#include <doctest/doctest.h>

#include <string>
#include <vector>

#include "error_of.hpp"
#include "k3/dplr.hpp"

using namespace k3;

namespace {
using k3::test::error_of;

// One float buffer holding every tensor, so that views can be made to overlap on purpose.
struct arena {
  index_t B = 1, T = 5, H = 2, K = 4, V = 4;
  std::vector<float> mem;
  index_t tok() const { return B * T * H * K; }
  index_t st() const { return B * H * K * V; }
  arena() : mem(std::size_t(20 * 40 * 4 + 64), 0.1f) {
    for (std::size_t i = 0; i < mem.size(); ++i) mem[i] = 0.01f * float(i % 17) - 0.05f;
  }
  // slot i: a [B,T,H,K] (or [N,H,K,V]) view starting at element i * 40
  tensor_view<float, 4> x(index_t i) { return host_view(mem.data() + i * 40, B, T, H, K); }
  tensor_view<float, 4> s(index_t i) { return host_view(mem.data() + i * 40, B, H, K, V); }
  dplr_inputs<float> in() { return {x(0), x(1), x(2), x(3), x(4), x(5), s(6)}; }
};

bool names(std::string const& e, char const* a, char const* b) {
  return e.find(std::string("'") + a + "'") != std::string::npos && e.find(std::string("'") + b + "'") != std::string::npos &&
         e.find("overlap") != std::string::npos;
}
}  // namespace

TEST_CASE("dplr forward: o over h0, ht over an input are rejected (recurrent and chunked)") {
  arena A;
  auto fwd = [&](dplr_outputs<float> const& o) {
    std::string e1 = error_of([&] { dplr_recurrent_forward(A.in(), o); });
    std::string e2 = error_of([&] { dplr_chunked_forward(cpu::threads<>(2), A.in(), o); });
    CHECK(e1 == e2);
    return e1;
  };
  CHECK(fwd({A.x(10), A.s(11)}) == "");
  CHECK(names(fwd({A.x(6), A.s(11)}), "o", "h0"));
  CHECK(names(fwd({A.x(10), A.s(2)}), "ht", "v"));
  CHECK(names(fwd({A.x(10), A.s(5)}), "ht", "gk"));
}

TEST_CASE("dplr backward: gradients over h0 / dht, dh0 over an input are rejected") {
  arena A;
  auto bwd = [&](dplr_grads<float> const& g) {
    dplr_grad_inputs<float> gi{A.x(7), A.s(8)};
    std::string e1 = error_of([&] { dplr_recurrent_backward(A.in(), gi, g); });
    std::string e2 = error_of([&] { dplr_chunked_backward(cpu::simd<>{}, A.in(), gi, g); });
    CHECK(e1 == e2);
    return e1;
  };
  CHECK(bwd({A.x(10), A.x(11), A.x(12), A.x(13), A.x(14), A.x(15), A.s(16)}) == "");
  CHECK(names(bwd({A.x(6), A.x(11), A.x(12), A.x(13), A.x(14), A.x(15), A.s(16)}), "dq", "h0"));
  CHECK(names(bwd({A.x(10), A.x(11), A.x(12), A.x(13), A.x(14), A.x(8), A.s(16)}), "dgk", "dht"));
  CHECK(names(bwd({A.x(10), A.x(11), A.x(12), A.x(13), A.x(14), A.x(15), A.s(0)}), "dh0", "q"));
  CHECK(names(bwd({A.x(10), A.x(11), A.x(12), A.x(13), A.x(14), A.x(15), A.s(7)}), "dh0", "do"));
  CHECK(names(bwd({A.x(10), A.x(11), A.x(12), A.x(13), A.x(14), A.x(15), A.s(8)}), "dh0", "dht"));
  CHECK(names(bwd({A.x(10), A.x(11), A.x(12), A.x(13), A.x(14), A.x(15), A.s(6)}), "dh0", "h0"));
}

TEST_CASE("dplr segment maps and map algebra: outputs over the span's inputs are rejected") {
  arena A;
  auto in = A.in();
  in.h0 = {};
  CHECK(error_of([&] { dplr_segment_maps(in, A.s(10), A.s(11)); }) == "");
  CHECK(names(error_of([&] { dplr_segment_maps(in, A.s(1), A.s(11)); }), "M", "k"));
  CHECK(names(error_of([&] { dplr_segment_maps(in, A.s(10), A.s(3), {}, cpu::threads<>(2)); }), "N", "a"));
  CHECK(names(error_of([&] { dplr_segment_maps_transposed(in, A.x(7), A.s(10), A.s(7)); }), "G", "do"));
  CHECK(names(error_of([&] { dplr_segment_maps_transposed(in, A.x(7), A.s(4), A.s(11)); }), "Mt", "b"));
  // S_out = M S_in + N with S_out over M (read again for every later column)
  CHECK(error_of([&] { dplr_apply_map<float>(A.s(10), A.s(11), A.s(12), A.s(13)); }) == "");
  CHECK(names(error_of([&] { dplr_apply_map<float>(A.s(10), A.s(11), A.s(12), A.s(10)); }), "S_out", "M"));
  CHECK(names(error_of([&] { dplr_apply_map<float>(A.s(10), A.s(11), A.s(12), tensor_view<float, 4>(A.s(11).data_handle() + 1, A.s(11).extents())); }),
              "S_out", "N"));
  // in place over N: the same result as into fresh memory
  std::vector<float> fresh(std::size_t(A.st()));
  dplr_apply_map<float>(A.s(10), A.s(11), A.s(12), host_view(fresh.data(), A.B, A.H, A.K, A.V));
  dplr_apply_map<float>(A.s(10), A.s(11), A.s(12), A.s(11));
  CHECK(std::vector<float>(A.s(11).data_handle(), A.s(11).data_handle() + A.st()) == fresh);
}

TEST_CASE("dplr context parallel: h0, dht and dh0 are checked against the other arguments too") {
  arena A;
  k3::single_process comm;
  dplr_grad_inputs<float> gi{A.x(7), A.s(8)};
  CHECK(names(error_of([&] { dplr_cp_forward(comm, A.in(), dplr_outputs<float>{A.x(6), A.s(11)}); }), "o", "h0"));
  CHECK(names(error_of([&] {
                dplr_cp_backward(comm, A.in(), gi, dplr_grads<float>{A.x(10), A.x(11), A.x(12), A.x(13), A.x(14), A.x(15), A.s(2)});
              }),
              "dh0", "v"));
  CHECK(error_of([&] {
          dplr_cp_backward(comm, A.in(), gi, dplr_grads<float>{A.x(10), A.x(11), A.x(12), A.x(13), A.x(14), A.x(15), A.s(16)});
        }) == "");
}

TEST_CASE("kda_as_dplr::grads_to_kda: null or overlapping outputs are rejected") {
  index_t const B = 1, T = 3, H = 1, HV = 2, K = 4, V = 4;
  std::vector<float> buf(std::size_t(64 * 20), 0.1f);
  auto at = [&](int i) { return buf.data() + 64 * i; };
  auto c = [](float* p) { return static_cast<float const*>(p); };
  kda_inputs<float> in{host_view(c(at(0)), B, T, H, K), host_view(c(at(1)), B, T, H, K), host_view(c(at(2)), B, T, HV, V),
                       host_view(c(at(3)), B, T, HV, K), host_view(c(at(4)), B, T, HV), {}};
  kda_as_dplr<float> m(in);
  dplr_grads<float> g{host_view(at(5), B, T, HV, K), host_view(at(6), B, T, HV, K), host_view(at(7), B, T, HV, V), host_view(at(8), B, T, HV, K),
                      host_view(at(9), B, T, HV, K), host_view(at(10), B, T, HV, K), {}};
  auto fold = [&](kda_grads<float> const& o) { return error_of([&] { m.grads_to_kda(g, o); }); };
  CHECK(fold({host_view(at(11), B, T, H, K), host_view(at(12), B, T, H, K), host_view(at(13), B, T, HV, V), host_view(at(14), B, T, HV, K),
              host_view(at(15), B, T, HV)}) == "");
  CHECK(fold({tensor_view<float, 4>(nullptr, {B, T, H, K}), host_view(at(12), B, T, H, K), host_view(at(13), B, T, HV, V),
              host_view(at(14), B, T, HV, K), host_view(at(15), B, T, HV)})
            .find("dq") != std::string::npos);
  CHECK(names(fold({host_view(at(5), B, T, H, K), host_view(at(12), B, T, H, K), host_view(at(13), B, T, HV, V), host_view(at(14), B, T, HV, K),
                    host_view(at(15), B, T, HV)}),
              "dq", "dq'"));
  CHECK(names(fold({host_view(at(11), B, T, H, K), host_view(at(12), B, T, H, K), host_view(at(13), B, T, HV, V), host_view(at(3), B, T, HV, K),
                    host_view(at(15), B, T, HV)}),
              "dg", "g"));
  CHECK(names(fold({host_view(at(11), B, T, H, K), host_view(at(12), B, T, H, K), host_view(at(13), B, T, HV, V), host_view(at(14), B, T, HV, K),
                    host_view(at(11) + 2, B, T, HV)}),
              "dq", "dbeta"));
}
