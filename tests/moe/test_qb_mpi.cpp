// Runs under mpirun -np 4. No doctest: every rank must take part in every collective.
// The distributed histogram update (all-reduce of integer counts) must give exactly the bias
// the single-process update gives on the pooled tokens, whatever the (uneven) sharding.
#include <cstdio>
#include <cstring>
#include <vector>

#include "k3/comm/mpi.hpp"
#include "support/mpi_check.hpp"
#include "moe/moe_test_util.hpp"

using namespace moe_test;
namespace moe = k3::moe;


int main(int argc, char** argv) {
  k3::mpi_session session(&argc, &argv);
  k3::mpi_communicator comm;
  int const r = comm.rank(), R = comm.size();
  index_t const m = 3001, n = 96, k = 6;  // m not divisible by the rank count
  moe::router_options opt;
  opt.k = k;
  // uneven shards: rank q gets a share growing with q (rank 0 may get very few tokens)
  std::vector<index_t> cut(static_cast<std::size_t>(R + 1), 0);
  index_t wsum = R * (R + 1) / 2;
  for (int q = 0; q < R; ++q) cut[q + 1] = cut[q] + m * (q + 1) / wsum;
  cut[R] = m;
  moe::quantile_balancer dist(n, opt), single(n, opt);
  k3::cpu::threads<> thr(2);
  for (int step = 0; step < 4; ++step) {
    auto s = skewed_scores(m, n, 4.0, 77 + std::uint64_t(step));  // every rank builds the global batch
    std::vector<std::uint8_t> mask(static_cast<std::size_t>(m), 1);
    for (index_t i = step; i < m; i += 37) mask[i] = 0;
    index_t a = cut[r], len = cut[r + 1] - cut[r];
    routed mine(len, k, n), all(m, k, n);
    k3::const_view<float, 2> shard(s.data() + a * n, {len, n});
    k3::const_view<std::uint8_t, 1> shard_mask(mask.data() + a, {len});
    if (r % 2) dist.route(thr, mine.args(shard, {}, shard_mask));
    else dist.route(k3::cpu::serial{}, mine.args(shard, {}, shard_mask));
    single.route(k3::cpu::serial{}, all.args(cview(s, m, n), {}, k3::const_view<std::uint8_t, 1>(mask.data(), {m})));
    // the shard's routing equals the corresponding rows of the single-process routing
    EXPECT(std::memcmp(mine.idx.data(), all.idx.data() + a * k, mine.idx.size() * sizeof(std::int32_t)) == 0);
    // a plain histogram all-reduce equals the pooled histogram
    auto h = moe::qb_histogram::for_bias(dist.bias(), 1000);
    moe::qb_accumulate(k3::cpu::serial{}, moe::qb_accumulate_args<float>{.scores = shard, .cutoff = k3::const_view<float, 1>(mine.cut.data(), {len}), .mask = shard_mask, .histogram = &h}, opt);
    h.all_reduce(comm);
    EXPECT(h == single.histogram());
    bool c1 = dist.step(k3::cpu::serial{}, moe::qb_step_args<decltype(comm)>{.comm = &comm}), c2 = single.step(k3::cpu::serial{});
    EXPECT(c1 && c2);
    EXPECT(std::memcmp(dist.bias().data_handle(), single.bias().data_handle(), sizeof(float) * n) == 0);
  }
  // the bias moved away from zero, so the equality is not vacuous
  double absb = 0;
  for (index_t j = 0; j < n; ++j) absb += std::fabs(dist.bias()(j));
  EXPECT(absb > 1.0);
  comm.barrier();
  return k3::test::mpi_verdict(comm);
}
