// k3/train/saved_tensors.hpp — the saved-tensor store of memory-efficient training (K3 §5.2.2,
// the unified activation manager): every tensor a forward keeps for its backward is saved under
// a policy, and the backward loads it back once.
//
//   k3::train::saved_tensor_store<k3::cpu::threads<>> store(cpu);
//   auto h = store.save(x, k3::train::fp8 | k3::train::offload);   // or keep, recompute, fp8, offload
//   auto r = store.save(y, k3::train::recompute, [&](auto out) { /* rewrite y into out */ });
//   ...
//   store.prefetch(h);          // offloaded bytes back into the resident pool ahead of use
//   store.load(h, x_again);     // writes the tensor back; the entry is released
//
// Policies (composable where it makes sense, chosen per tensor by the annotation at save):
//   keep       a copy in the resident pool.
//   recompute  nothing stored: the callable given to save rewrites the tensor at load (it may
//              re-run any number of ops, across layers); it must not be combined with others.
//   fp8        DeepSeek 1x128 E4M3 codes and one float scale per 128 values of a row (the
//              tensor as its [size / last, last] matrix), through k3's quantiser: about 1/4 of a
//              float tensor's bytes, 1/2 of a bfloat16 one's. The price is the E4M3 rounding
//              (relative error up to 2^-4 of a value, subnormal steps of a tile's amax / 448 /
//              2^9): the load returns dequantize(quantize(x)), and a tile holding NaN or Inf
//              loads as NaN (that tile only). Float, double (through float) and bfloat16 only.
//   offload    the bytes (a copy, or fp8's codes with fp8 | offload) in the host pool, out of
//              the resident pool, until prefetch() or load() brings them back.
// The store owns two pools with statistics: resident bytes (what a GPU would hold) and host
// bytes, each with its peak; saved_bytes counts what save() stored in either. The CUDA store
// (device views, offload through pinned memory and a side stream) is in saved_tensors.cuh.
//
// Errors (k3::error): a second load or a load after release of the same handle, a handle the
// store never issued, a load into a view of another shape or element type, fp8 of an integer
// tensor, recompute without a callable or combined with another policy.
#pragma once
#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <type_traits>
#include <tuple>
#include <typeinfo>
#include <utility>
#include <vector>

#include "k3/core/concepts.hpp"
#include "k3/core/error.hpp"
#include "k3/core/numeric/bfloat16.hpp"
#include "k3/core/tensor_view.hpp"
#include "k3/core/validate.hpp"
#include "k3/quant.hpp"

namespace k3::train {

enum class save_policy : unsigned { keep = 0, recompute = 1, fp8 = 2, offload = 4 };

constexpr save_policy operator|(save_policy a, save_policy b) noexcept {
  return static_cast<save_policy>(static_cast<unsigned>(a) | static_cast<unsigned>(b));
}
constexpr bool has_policy(save_policy p, save_policy flag) noexcept {
  return (static_cast<unsigned>(p) & static_cast<unsigned>(flag)) != 0;
}

inline constexpr save_policy keep = save_policy::keep, recompute = save_policy::recompute, fp8 = save_policy::fp8,
                             offload = save_policy::offload;

static_assert(has_policy(fp8 | offload, offload) && has_policy(fp8 | offload, fp8) && !has_policy(keep, fp8));

inline std::string policy_name(save_policy p) {
  if (p == keep) return "keep";
  std::string s;
  for (auto [flag, name] : {std::pair{recompute, "recompute"}, std::pair{fp8, "fp8"}, std::pair{offload, "offload"}})
    if (has_policy(p, flag)) s += (s.empty() ? "" : "|") + std::string(name);
  return s;
}

struct pool_stats {
  std::size_t resident_bytes = 0, resident_peak_bytes = 0;
  std::size_t host_bytes = 0, host_peak_bytes = 0;
  std::size_t saved_bytes = 0;  // everything save() stored, in either pool, since construction
};

// What save() returns: names one saved tensor of one store.
struct saved_handle {
  std::uint64_t id = 0;
};

namespace detail {

// One pool's byte count and peak; blocks hand their bytes back when freed.
class pool_account {
 public:
  void add(std::size_t n) noexcept {
    now_ += n;
    peak_ = std::max(peak_, now_);
  }
  void remove(std::size_t n) noexcept { now_ -= n; }
  std::size_t now() const noexcept { return now_; }
  std::size_t peak() const noexcept { return peak_; }

 private:
  std::size_t now_ = 0, peak_ = 0;
};

// The store's statistics: its running totals with the two pools' current and peak bytes.
inline pool_stats stats_of(pool_stats s, pool_account const& resident, pool_account const& host) noexcept {
  s.resident_bytes = resident.now();
  s.resident_peak_bytes = resident.peak();
  s.host_bytes = host.now();
  s.host_peak_bytes = host.peak();
  return s;
}

class pool_block {
 public:
  pool_block() = default;
  pool_block(pool_account& a, std::size_t n) : acc_(&a), bytes_(n), data_(n ? std::make_unique<std::byte[]>(n) : nullptr) { a.add(n); }
  pool_block(pool_block&& o) noexcept : acc_(std::exchange(o.acc_, nullptr)), bytes_(std::exchange(o.bytes_, 0)), data_(std::move(o.data_)) {}
  pool_block& operator=(pool_block&& o) noexcept {
    if (this != &o) {
      reset();
      acc_ = std::exchange(o.acc_, nullptr);
      bytes_ = std::exchange(o.bytes_, 0);
      data_ = std::move(o.data_);
    }
    return *this;
  }
  ~pool_block() { reset(); }
  void reset() noexcept {
    if (acc_) acc_->remove(bytes_);
    acc_ = nullptr;
    bytes_ = 0;
    data_.reset();
  }
  std::byte* data() const noexcept { return data_.get(); }
  std::size_t bytes() const noexcept { return bytes_; }

 private:
  pool_account* acc_ = nullptr;
  std::size_t bytes_ = 0;
  std::unique_ptr<std::byte[]> data_;
};

template <class T>
inline constexpr bool fp8_storable = std::is_same_v<T, float> || std::is_same_v<T, double> || std::is_same_v<T, bfloat16>;

// What the quantiser reads: float for float and double, bfloat16 as itself.
template <class T>
using fp8_source_t = std::conditional_t<std::is_same_v<T, bfloat16>, bfloat16, float>;

template <class T>
std::string element_name() {
  if constexpr (std::is_same_v<T, float>) return "float32";
  else if constexpr (std::is_same_v<T, double>) return "float64";
  else if constexpr (std::is_same_v<T, bfloat16>) return "bfloat16";
  else if constexpr (std::is_integral_v<T>) return (std::is_signed_v<T> ? "int" : "uint") + std::to_string(8 * sizeof(T));
  else return typeid(T).name();
}

// What every backend's entry records of a saved tensor, and the check of a load's target.
struct saved_meta {
  save_policy policy = keep;
  std::type_info const* type = nullptr;
  std::string type_name;
  std::vector<index_t> shape;

  template <class T, class V>
  void describe(save_policy p, V const& x) {
    policy = p;
    type = &typeid(T);
    type_name = element_name<T>();
    shape.clear();
    for (std::size_t r = 0; r < V::rank(); ++r) shape.push_back(x.extent(r));
  }
  template <class T, class V>
  void check_target(V const& out) const {
    bool same = *type == typeid(T) && shape.size() == V::rank();
    for (std::size_t r = 0; same && r < V::rank(); ++r) same = shape[r] == out.extent(r);
    if (same) return;
    std::string s = "[";
    for (std::size_t r = 0; r < shape.size(); ++r) s += (r ? ", " : "") + std::to_string(shape[r]);
    throw ::k3::error(error_kind::shape, "argument 'out': expected a " + type_name + " tensor of shape " + s + "], got " + element_name<T>() + " " +
                      ::k3::detail::shape_of(out));
  }
};

// The policy bits a save may carry: recompute alone (with its callable), or any of fp8, offload.
inline void check_policy(save_policy p, bool has_callable) {
  ::k3::detail::require(static_cast<unsigned>(p) <= 7u, error_kind::value, [&] { return "save: unknown policy bits " + std::to_string(static_cast<unsigned>(p)); });
  if (!has_policy(p, recompute)) return;
  ::k3::detail::require(p == recompute, error_kind::value, [&] { return "save: policy " + policy_name(p) + ": recompute stores nothing and combines with no other policy"; });
  ::k3::detail::require(has_callable, error_kind::value, "save: policy recompute needs the callable that recomputes the tensor");
}

// The handles of one store: each issued once, each entry loaded or released once.
template <class Entry>
class saved_book {
 public:
  saved_handle issue(Entry e) {
    std::uint64_t const id = ++last_;
    entries_.emplace(id, std::move(e));
    return {id};
  }
  Entry& find(saved_handle h, char const* what) {
    auto it = entries_.find(h.id);
    if (it != entries_.end()) return it->second;
    auto gone = gone_.find(h.id);
    if (gone != gone_.end())
      throw ::k3::error(error_kind::value, std::string(what) + ": saved tensor " + std::to_string(h.id) + " was already " + gone->second +
                        " (each saved tensor is loaded once)");
    throw ::k3::error(error_kind::value, std::string(what) + ": handle " + std::to_string(h.id) + " was not issued by this store");
  }
  void consume(saved_handle h, char const* how) {
    entries_.erase(h.id);
    gone_.emplace(h.id, how);
  }
  std::size_t size() const noexcept { return entries_.size(); }
  template <class F>
  void each(F&& f) {
    for (auto& [id, e] : entries_) f(e);
  }

 private:
  std::uint64_t last_ = 0;
  std::map<std::uint64_t, Entry> entries_;
  std::map<std::uint64_t, std::string> gone_;
};

}  // namespace detail

// One store per backend kind: the host backends' below, CUDA's in k3/train/saved_tensors.cuh.
template <class Backend>
class saved_tensor_store;

template <HostBackend Bk>
class saved_tensor_store<Bk> {
 public:
  explicit saved_tensor_store(Bk b = {}) : b_(std::move(b)) {}
  saved_tensor_store(saved_tensor_store const&) = delete;
  saved_tensor_store& operator=(saved_tensor_store const&) = delete;

  // Saves x under policy p (recompute: `again` rewrites the tensor into the view it is given).
  template <class T, std::size_t R>
  saved_handle save(tensor_view<T, R> x_in, save_policy p, std::type_identity_t<std::function<void(tensor_view<std::remove_const_t<T>, R>)>> again = {}) {
    using S = std::remove_const_t<T>;
    static_assert(std::is_trivially_copyable_v<S>, "saved_tensor_store: elements must be trivially copyable");
    static_assert(R >= 1, "saved_tensor_store: a tensor of rank >= 1");
    const_view<S, R> const x = x_in;
    ::k3::detail::check_view("x", x);
    detail::check_policy(p, static_cast<bool>(again));
    entry e;
    e.template describe<S>(p, x);
    index_t const cols = x.extent(R - 1), rows = cols ? x.size() / cols : 0;
    if (has_policy(p, recompute)) {
      e.recompute = [again = std::move(again), shape = x.extents()](void* out) { again(tensor_view<S, R>(static_cast<S*>(out), shape)); };
    } else if (has_policy(p, fp8)) {
      if constexpr (!detail::fp8_storable<S>) {
        throw ::k3::error(error_kind::dtype, "save: policy " + policy_name(p) + " cannot apply to a tensor of " + e.type_name + " (block FP8 holds float, float64 or bfloat16)");
      } else {
        index_t const sc = (cols + 127) / 128;
        e.rows = rows;
        e.cols = cols;
        e.data = block(p, static_cast<std::size_t>(rows * cols) + static_cast<std::size_t>(rows * sc) * sizeof(float));
        // Scales first: the block's start is aligned for them.
        auto* sp = reinterpret_cast<float*>(e.data.data());
        auto* q = reinterpret_cast<std::uint8_t*>(sp + rows * sc);
        if (rows * cols > 0) {
          using Q = detail::fp8_source_t<S>;
          std::vector<Q> flat(static_cast<std::size_t>(rows * cols));
          copy_out(x, flat.data(), [](S v) { return static_cast<Q>(v); });
          ::k3::quant::fp8_quantize(b_, ::k3::quant::fp8_quantize_args<Q>{.x = tensor_view<Q const, 2>(flat.data(), {rows, cols}),
                                                                          .q = tensor_view<std::uint8_t, 2>(q, {rows, cols}),
                                                                          .scales = tensor_view<float, 2>(sp, {rows, sc})});
        }
      }
    } else {
      e.data = block(p, static_cast<std::size_t>(x.size()) * sizeof(S));
      copy_out(x, reinterpret_cast<S*>(e.data.data()), [](S v) { return v; });
    }
    stats_.saved_bytes += e.data.bytes();
    return book_.issue(std::move(e));
  }

 private:
  struct entry;

 public:
  // Brings an offloaded tensor's bytes into the resident pool ahead of its load.
  void prefetch(saved_handle h) {
    entry& e = book_.find(h, "prefetch");
    if (!has_policy(e.policy, offload) || e.resident) return;
    detail::pool_block moved(resident_, e.data.bytes());
    if (e.data.bytes()) std::memcpy(moved.data(), e.data.data(), e.data.bytes());
    e.data = std::move(moved);
    e.resident = true;
  }

  // Writes the saved tensor into out (its shape and element type) and releases the entry.
  template <class T, std::size_t R>
  void load(saved_handle h, tensor_view<T, R> out) {
    static_assert(!std::is_const_v<T>, "saved_tensor_store::load writes into out");
    entry& e = book_.find(h, "load");
    ::k3::detail::check_view("out", out);
    e.template check_target<T>(out);
    if (has_policy(e.policy, recompute)) {
      std::vector<T> tmp(static_cast<std::size_t>(out.size()));
      e.recompute(tmp.data());
      copy_in(tmp.data(), out, [](T v) { return v; });
    } else if (has_policy(e.policy, fp8)) {
      if constexpr (detail::fp8_storable<T>) load_fp8(e, out);
    } else {
      copy_in(reinterpret_cast<T const*>(e.data.data()), out, [](T v) { return v; });
    }
    book_.consume(h, "loaded");
  }

  // Drops a saved tensor without loading it (a backward that does not need it).
  void release(saved_handle h) {
    book_.find(h, "release");
    book_.consume(h, "released");
  }

  pool_stats stats() const noexcept {
    return detail::stats_of(stats_, resident_, host_);
  }
  std::size_t size() const noexcept { return book_.size(); }

 private:
  struct entry : detail::saved_meta {
    index_t rows = 0, cols = 0;
    detail::pool_block data;
    bool resident = false;
    std::function<void(void*)> recompute;
  };

  detail::pool_block block(save_policy p, std::size_t bytes) { return detail::pool_block(has_policy(p, offload) ? host_ : resident_, bytes); }

  // Row-major copies between a strided view and contiguous memory.
  template <class V, class D, class F>
  static void copy_out(V const& x, D* dst, F&& f) {
    std::size_t i = 0;
    for_each_index(x, [&](auto const&... ix) { dst[i++] = f(x(ix...)); });
  }
  template <class D, class V, class F>
  static void copy_in(D const* src, V const& out, F&& f) {
    std::size_t i = 0;
    for_each_index(out, [&](auto const&... ix) { out(ix...) = f(src[i++]); });
  }
  template <class V, class F>
  static void for_each_index(V const& v, F&& f) {
    constexpr std::size_t R = V::rank();
    if (v.size() == 0) return;
    std::array<index_t, R> ix{};
    for (;;) {
      std::apply([&](auto... i) { f(i...); }, ix);
      std::size_t r = R;
      while (r-- > 0) {
        if (++ix[r] < v.extent(r)) break;
        ix[r] = 0;
        if (r == 0) return;
      }
    }
  }

  template <class T, std::size_t R>
  void load_fp8(entry& e, tensor_view<T, R> out) {
    if (e.rows * e.cols == 0) return;
    using Q = detail::fp8_source_t<T>;
    index_t const sc = (e.cols + 127) / 128;
    auto const* sp = reinterpret_cast<float const*>(e.data.data());
    auto const* q = reinterpret_cast<std::uint8_t const*>(sp + e.rows * sc);
    std::vector<Q> flat(static_cast<std::size_t>(e.rows * e.cols));
    ::k3::quant::fp8_dequantize(b_, ::k3::quant::fp8_dequantize_args<Q>{.q = tensor_view<std::uint8_t const, 2>(q, {e.rows, e.cols}),
                                                                        .scales = tensor_view<float const, 2>(sp, {e.rows, sc}),
                                                                        .y = tensor_view<Q, 2>(flat.data(), {e.rows, e.cols})});
    copy_in(flat.data(), out, [](Q v) { return static_cast<T>(static_cast<float>(v)); });
  }

  Bk b_;
  detail::pool_account resident_, host_;
  pool_stats stats_;
  detail::saved_book<entry> book_;
};

}  // namespace k3::train
