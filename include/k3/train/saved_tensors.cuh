// k3/train/saved_tensors.cuh — the saved-tensor store on a CUDA backend: saved_tensor_store<
// cuda::stream_backend> takes device views, with the host store's calls, handles, statistics and
// errors (k3/train/saved_tensors.hpp). Include from a .cu file (or a host file built for k3's
// SIMT runtime).
//
//   keep       a device copy, made on the backend's (main) stream.
//   recompute  nothing stored; the callable writes the device view it is given at load.
//   offload    page-locked host memory, filled by an asynchronous copy on the store's side stream
//              once the main stream has produced the tensor; the main stream's later work waits
//              for that copy (so the caller may overwrite the tensor), not the host. prefetch()
//              copies it back to a device buffer on the side stream ahead of use; load() makes
//              the main stream wait for whichever copy it reads.
//   fp8        float and bfloat16 tensors: k3::quant::cuda's 1x128 E4M3 codes and scales (the
//              host store's layout and bytes) on the main stream; with offload the codes go to
//              pinned memory on the side stream, and the store waits for that copy before it
//              frees the device staging buffer. A bfloat16 load dequantises in float and rounds
//              to bfloat16 (to nearest even), as the host store does. Other element types are an
//              error on this backend.
// Views must be contiguous (one copy per tensor).
#pragma once
#include "k3/backend/cuda/config.cuh"
// (config.cuh first: it refuses host compilers)
#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <type_traits>
#include <utility>

#include "k3/backend/cuda/backend.cuh"
#include "k3/core/concepts.hpp"
#include "k3/core/memory_space.hpp"
#include "k3/quant/cuda.cuh"
#include "k3/train/saved_tensors.hpp"

namespace k3::train {

namespace detail {

template <class T>
inline constexpr bool fp8_device_storable = std::is_same_v<T, float> || std::is_same_v<T, bfloat16>;

// out[i] = bfloat16(in[i]) on the device (a dequantised bfloat16 load).
struct narrow_to_bfloat16 {
  float const* in;
  bfloat16* out;
  K3_INLINE void operator()(std::int64_t i) const { out[i] = bfloat16(in[i]); }
};

}  // namespace detail

template <CudaBackend Bk>
class saved_tensor_store<Bk> {
 public:
  explicit saved_tensor_store(Bk b = {}) : b_(std::move(b)) {
    K3_CUDA_CHECK(cudaStreamCreateWithFlags(&side_, cudaStreamNonBlocking));
  }
  saved_tensor_store(saved_tensor_store const&) = delete;
  saved_tensor_store& operator=(saved_tensor_store const&) = delete;
  ~saved_tensor_store() {
    cudaStreamSynchronize(side_);
    try {
      book_.each([&](entry& e) { free(e); });
    } catch (...) {  // a destructor reports nothing; the memory goes with the process
    }
    cudaStreamDestroy(side_);
  }

  template <class T, std::size_t R>
  saved_handle save(tensor_view<T, R, cuda_device_space> x_in, save_policy p,
                    std::type_identity_t<std::function<void(tensor_view<std::remove_const_t<T>, R, cuda_device_space>)>> again = {}) {
    using S = std::remove_const_t<T>;
    static_assert(std::is_trivially_copyable_v<S>, "saved_tensor_store: elements must be trivially copyable");
    static_assert(R >= 1, "saved_tensor_store: a tensor of rank >= 1");
    tensor_view<S const, R, cuda_device_space> const x = x_in;
    ::k3::detail::check_view("x", x);
    ::k3::detail::require(x.is_contiguous(), error_kind::shape, [&] { return "argument 'x': the CUDA store saves contiguous views (shape " + ::k3::detail::shape_of(x) + ")"; });
    detail::check_policy(p, static_cast<bool>(again));
    ::k3::detail::require(!has_policy(p, fp8) || detail::fp8_device_storable<S>, error_kind::dtype, [&] {
      return "save: policy " + policy_name(p) + " on the CUDA backend holds float32 or bfloat16 tensors, got " + detail::element_name<S>();
    });
    entry e;
    e.template describe<S>(p, x);
    e.bytes = static_cast<std::size_t>(x.size()) * sizeof(S);
    if (has_policy(p, fp8)) {
      e.cols = x.extent(R - 1);
      e.rows = e.cols ? x.size() / e.cols : 0;
      e.bytes = static_cast<std::size_t>(e.rows * scale_cols(e)) * sizeof(float) + static_cast<std::size_t>(e.rows * e.cols);
    }
    if (has_policy(p, recompute)) {
      e.recompute = [again = std::move(again), shape = x.extents()](void* out) {
        again(tensor_view<S, R, cuda_device_space>(static_cast<S*>(out), shape));
      };
    } else if (has_policy(p, fp8)) {
      if constexpr (detail::fp8_device_storable<S>) {
        bool const off = has_policy(p, offload);
        std::byte* dev = b_.template allocate<std::byte>(e.bytes ? e.bytes : 1);
        if (e.rows * e.cols > 0) quantize(e, tensor_view<S const, 2, cuda_device_space>(x.data_handle(), {e.rows, e.cols}), dev);
        if (off) {
          e.host = pinned(e.bytes);
          host_.add(e.bytes);
          if (e.bytes) {
            cudaEvent_t produced = after(b_.stream(), side_);
            K3_CUDA_CHECK(cudaMemcpyAsync(e.host, dev, e.bytes, cudaMemcpyDeviceToHost, side_));
            drop_event(produced);
          }
          K3_CUDA_CHECK(cudaStreamSynchronize(side_));  // the staging buffer goes now
          b_.deallocate(dev, e.bytes ? e.bytes : 1);
        } else {
          e.device = dev;
          resident_.add(e.bytes);
        }
      }
    } else if (has_policy(p, offload)) {
      e.host = pinned(e.bytes);
      host_.add(e.bytes);
      if (e.bytes) {
        cudaEvent_t produced = after(b_.stream(), side_);  // the tensor is complete on the main stream
        K3_CUDA_CHECK(cudaMemcpyAsync(e.host, x.data_handle(), e.bytes, cudaMemcpyDeviceToHost, side_));
        drop_event(produced);
        e.ready = after(side_, b_.stream());  // later main-stream work may overwrite x
      }
    } else {
      e.device = b_.template allocate<std::byte>(e.bytes ? e.bytes : 1);
      resident_.add(e.bytes);
      if (e.bytes) K3_CUDA_CHECK(cudaMemcpyAsync(e.device, x.data_handle(), e.bytes, cudaMemcpyDeviceToDevice, b_.stream()));
    }
    stats_.saved_bytes += has_policy(p, recompute) ? 0 : e.bytes;
    return book_.issue(std::move(e));
  }

  // Starts the copy of an offloaded tensor back to the device on the side stream.
  void prefetch(saved_handle h) {
    entry& e = book_.find(h, "prefetch");
    if (!has_policy(e.policy, offload) || e.device) return;
    e.device = b_.template allocate<std::byte>(e.bytes ? e.bytes : 1);
    resident_.add(e.bytes);
    if (e.bytes) {
      K3_CUDA_CHECK(cudaMemcpyAsync(e.device, e.host, e.bytes, cudaMemcpyHostToDevice, side_));
      drop_event(e.ready);
      e.ready = record(side_);
    }
  }

  // Writes the saved tensor into out on the main stream and releases the entry.
  template <class T, std::size_t R>
  void load(saved_handle h, tensor_view<T, R, cuda_device_space> out) {
    static_assert(!std::is_const_v<T>, "saved_tensor_store::load writes into out");
    entry& e = book_.find(h, "load");
    ::k3::detail::check_view("out", out);
    e.template check_target<T>(out);
    ::k3::detail::require(out.is_contiguous(), error_kind::shape, "argument 'out': the CUDA store loads into contiguous views");
    if (has_policy(e.policy, recompute)) {
      e.recompute(out.data_handle());
    } else if (has_policy(e.policy, fp8)) {
      if constexpr (detail::fp8_device_storable<T>) {
        if (e.rows * e.cols > 0) {
          if (e.ready) K3_CUDA_CHECK(cudaStreamWaitEvent(b_.stream(), e.ready, 0));
          std::byte* src = e.device;
          std::byte* staged = nullptr;
          if (!src) {
            staged = b_.template allocate<std::byte>(e.bytes);
            K3_CUDA_CHECK(cudaMemcpyAsync(staged, e.host, e.bytes, cudaMemcpyHostToDevice, b_.stream()));
            src = staged;
          }
          std::size_t const n = static_cast<std::size_t>(e.rows * e.cols);
          float* wide = nullptr;
          if constexpr (std::is_same_v<T, float>) {
            dequantize(e, src, tensor_view<float, 2, cuda_device_space>(out.data_handle(), {e.rows, e.cols}));
          } else {
            wide = b_.template allocate<float>(n);
            dequantize(e, src, tensor_view<float, 2, cuda_device_space>(wide, {e.rows, e.cols}));
            b_.for_each(0, static_cast<std::int64_t>(n), detail::narrow_to_bfloat16{wide, out.data_handle()});
          }
          if (staged || wide) {
            b_.fence();
            if (staged) b_.deallocate(staged, e.bytes);
            if (wide) b_.deallocate(wide, n);
          }
        }
      }
    } else if (e.bytes) {
      if (e.ready) K3_CUDA_CHECK(cudaStreamWaitEvent(b_.stream(), e.ready, 0));
      if (e.device)
        K3_CUDA_CHECK(cudaMemcpyAsync(out.data_handle(), e.device, e.bytes, cudaMemcpyDeviceToDevice, b_.stream()));
      else
        K3_CUDA_CHECK(cudaMemcpyAsync(out.data_handle(), e.host, e.bytes, cudaMemcpyHostToDevice, b_.stream()));
    }
    free(e);
    book_.consume(h, "loaded");
  }

  void release(saved_handle h) {
    free(book_.find(h, "release"));
    book_.consume(h, "released");
  }

  pool_stats stats() const noexcept {
    return detail::stats_of(stats_, resident_, host_);
  }
  std::size_t size() const noexcept { return book_.size(); }

 private:
  struct entry : detail::saved_meta {
    index_t rows = 0, cols = 0;  // fp8: the tensor as its [size / last, last] matrix
    std::size_t bytes = 0;
    std::byte* device = nullptr;
    void* host = nullptr;
    cudaEvent_t ready = nullptr;
    std::function<void(void*)> recompute;
  };

  // fp8 blocks: the scales [rows, ceil(cols / 128)] first (aligned), then the codes [rows, cols].
  static index_t scale_cols(entry const& e) { return (e.cols + 127) / 128; }
  template <class S>
  void quantize(entry const& e, tensor_view<S const, 2, cuda_device_space> x, std::byte* block) const {
    auto* sp = reinterpret_cast<float*>(block);
    auto* q = reinterpret_cast<std::uint8_t*>(sp + e.rows * scale_cols(e));
    ::k3::quant::cuda::fp8_quantize<S>(x, tensor_view<std::uint8_t, 2, cuda_device_space>(q, {e.rows, e.cols}),
                                           tensor_view<float, 2, cuda_device_space>(sp, {e.rows, scale_cols(e)}), ::k3::quant::tile_1x128,
                                           ::k3::quant::scale_format::fp32, b_.stream());
  }
  void dequantize(entry const& e, std::byte const* block, tensor_view<float, 2, cuda_device_space> y) const {
    auto const* sp = reinterpret_cast<float const*>(block);
    auto const* q = reinterpret_cast<std::uint8_t const*>(sp + e.rows * scale_cols(e));
    ::k3::quant::cuda::fp8_dequantize(tensor_view<std::uint8_t const, 2, cuda_device_space>(q, {e.rows, e.cols}),
                                      tensor_view<float const, 2, cuda_device_space>(sp, {e.rows, scale_cols(e)}), y, ::k3::quant::tile_1x128,
                                      b_.stream());
  }

  static void* pinned(std::size_t bytes) {
    void* p = nullptr;
    if (bytes) K3_CUDA_CHECK(cudaMallocHost(&p, bytes));
    return p;
  }
  static cudaEvent_t record(cudaStream_t s) {
    cudaEvent_t ev = nullptr;
    K3_CUDA_CHECK(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
    K3_CUDA_CHECK(cudaEventRecord(ev, s));
    return ev;
  }
  // `waiter` waits for what `s` has issued so far; returns the event (the caller owns it).
  static cudaEvent_t after(cudaStream_t s, cudaStream_t waiter) {
    cudaEvent_t ev = record(s);
    K3_CUDA_CHECK(cudaStreamWaitEvent(waiter, ev, 0));
    return ev;
  }
  static void drop_event(cudaEvent_t& ev) {
    if (ev) cudaEventDestroy(ev);
    ev = nullptr;
  }
  // The buffers go once the streams have finished with them.
  void free(entry& e) {
    K3_CUDA_CHECK(cudaStreamSynchronize(side_));
    b_.fence();
    drop_event(e.ready);
    if (e.device) {
      b_.deallocate(e.device, e.bytes ? e.bytes : 1);
      resident_.remove(e.bytes);
      e.device = nullptr;
    }
    if (e.host) {
      cudaFreeHost(e.host);
      e.host = nullptr;
    }
    if (has_policy(e.policy, offload)) host_.remove(e.bytes);
  }

  Bk b_;
  cudaStream_t side_ = nullptr;
  detail::pool_account resident_, host_;
  pool_stats stats_;
  detail::saved_book<entry> book_;
};

}  // namespace k3::train
