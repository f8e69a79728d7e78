// Runs under mpirun -np 2, 3 and 4. No doctest: every rank must take part in every exchange.
// P2P Muon on sharded matrices must give, on every rank, exactly its shard of the single-process
// NS5 of each whole matrix (bit for bit), with the non-blocking MPI path and with the blocking
// schedule any communicator gets, in float, double and bfloat16; each rank must receive what
// the plan says (p2p_traffic_of), and no rank more than 1.5x the average.
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "k3/backend/cpu/simd.hpp"
#include "k3/comm/mpi.hpp"
#include "k3/optim/p2p_muon.hpp"
#include "support/mpi_check.hpp"

namespace optim = k3::optim;
using k3::index_t;

namespace {

// The MPI communicator without isend/irecv: the blocking schedule.
struct blocking_only {
  k3::mpi_communicator const* c;
  int rank() const { return c->rank(); }
  int size() const { return c->size(); }
  template <class V>
  void all_reduce_sum(V v) const {
    c->all_reduce_sum(v);
  }
  template <class A, class B>
  void all_gather(A a, B b) const {
    c->all_gather(a, b);
  }
  template <class V>
  void send(V v, int peer, int tag) const {
    c->send(v, peer, tag);
  }
  template <class V>
  void recv(V v, int peer, int tag) const {
    c->recv(v, peer, tag);
  }
  void barrier() const { c->barrier(); }
};
static_assert(k3::Communicator<blocking_only>);
static_assert(!k3::NonBlockingCommunicator<blocking_only>);
static_assert(k3::NonBlockingCommunicator<k3::mpi_communicator>);

template <class T, class Comm>
void check_set(Comm const& comm, std::vector<optim::matrix_shape> const& shapes, unsigned seed, char const* what) {
  int const me = comm.rank(), N = comm.size();
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> nd;
  std::vector<std::vector<T>> whole(shapes.size());
  for (std::size_t j = 0; j < shapes.size(); ++j) {
    whole[j].resize(static_cast<std::size_t>(shapes[j].elements()));
    for (auto& x : whole[j]) x = k3::store_as<T>(nd(rng));
  }
  // This rank's shards.
  std::vector<std::vector<T>> gs(shapes.size()), os(shapes.size());
  std::vector<k3::tensor_view<T const, 1>> gin;
  std::vector<k3::tensor_view<T, 1>> oout;
  for (std::size_t j = 0; j < shapes.size(); ++j) {
    auto const sh = optim::shard_of(shapes[j].elements(), me, N);
    gs[j].assign(whole[j].begin() + sh.begin, whole[j].begin() + sh.end);
    os[j].assign(gs[j].size(), k3::store_as<T>(-7.f));
    gin.emplace_back(gs[j].data(), k3::array<index_t, 1>{sh.size()});
    oout.emplace_back(os[j].data(), k3::array<index_t, 1>{sh.size()});
  }
  auto const plan = optim::make_p2p_plan(shapes, N);
  k3::cpu::threads<> cpu(me % 2 ? 1 : 2);  // different thread counts on different ranks
  auto const st = optim::p2p_newton_schulz(cpu, optim::p2p_newton_schulz_args<Comm, T>{comm, plan, shapes, gin, oout});
  // Single-process reference of every whole matrix.
  bool same = true;
  for (std::size_t j = 0; j < shapes.size(); ++j) {
    std::vector<T> ref(whole[j].size());
    optim::newton_schulz(k3::cpu::serial{},
                         optim::newton_schulz_args<T>{{whole[j].data(), {shapes[j].rows, shapes[j].cols}}, {ref.data(), {shapes[j].rows, shapes[j].cols}}},
                         {.heads = shapes[j].heads});
    auto const sh = optim::shard_of(shapes[j].elements(), me, N);
    // (an empty shard has no data pointer to compare)
    same = same && (sh.size() == 0 || std::memcmp(ref.data() + sh.begin, os[j].data(), sizeof(T) * static_cast<std::size_t>(sh.size())) == 0);
  }
  EXPECT(same, "%s: rank %d's shards differ from the single-process NS5", what, me);
  auto const traffic = optim::p2p_traffic_of(plan, shapes, sizeof(T));
  EXPECT(st.recv_bytes == traffic.recv_bytes[static_cast<std::size_t>(me)], "%s: rank %d received %lld bytes, the plan says %lld", what, me,
         (long long)st.recv_bytes, (long long)traffic.recv_bytes[static_cast<std::size_t>(me)]);
  std::int64_t total = 0, worst = 0;
  for (auto b : traffic.recv_bytes) total += b, worst = std::max(worst, b);
  EXPECT(worst <= 1.5 * double(total) / N, "%s: max %lld bytes received vs average %g", what, (long long)worst, double(total) / N);
  // Every rank of an all-gather receives (N - 1)/N of the set; P2P moves 2/N of that in all
  // (up to the shards' rounding).
  std::int64_t const slack = static_cast<std::int64_t>(shapes.size() * sizeof(T)) * N;
  EXPECT(total <= 2 * traffic.all_gather_recv_bytes + slack, "%s: P2P moves %lld bytes, all-gather %lld", what, (long long)total,
         (long long)(traffic.all_gather_recv_bytes * N));
}

}  // namespace

int main(int argc, char** argv) {
  k3::mpi_session session(&argc, &argv);
  k3::mpi_communicator comm;
  // A K3-like set scaled down: per-head attention projections, wide and tall MoE-like matrices,
  // a square one, and tiny ones where some ranks hold an empty shard.
  std::vector<optim::matrix_shape> shapes = {{96, 256, 6}, {256, 96}, {128, 384}, {384, 128}, {64, 64}, {300, 40}, {40, 300},
                                             {1, 2},       {2, 1},    {1, 1},     {17, 29, 1}, {48, 80, 4}, {80, 48}, {33, 65}};
  check_set<float>(comm, shapes, 1, "float, non-blocking");
  check_set<double>(comm, shapes, 2, "double, non-blocking");
  check_set<k3::bfloat16>(comm, shapes, 3, "bfloat16, non-blocking");
  blocking_only blocking{&comm};
  check_set<float>(blocking, shapes, 4, "float, blocking");
  check_set<k3::bfloat16>(blocking, shapes, 5, "bfloat16, blocking");
  // Ranks that disagree on the plan get an error on every rank, not a hang.
  std::vector<optim::matrix_shape> mine = {{8, 8}, {8, 8}};
  if (comm.rank() == 1) mine[1].cols = 9;
  bool threw = false;
  try {
    check_set<float>(comm, mine, 6, "mismatch");
  } catch (k3::error const& e) {
    threw = std::strstr(e.what(), "do not hold the same plan") != nullptr;
  }
  EXPECT(threw, "ranks with different shapes must all throw");
  return k3::test::mpi_verdict(comm);
}
