// The scheduler behind emu.h, plus stand-ins for the few CUDA runtime calls the host code makes.
#include <ucontext.h>

#include <cstdio>
#include <memory>

#include "emu.h"

namespace emu {
namespace {

enum Wait { kRunning = 0, kBlock = 1, kWarp = 2, kDone = 3 };
constexpr size_t kStack = 256 * 1024;

struct Thread {
  ucontext_t ctx;
  uint3 idx;
  int linear = 0;
  int state = kRunning;
  uint64_t shuffle_round = 0;
  std::vector<CopyOp> open;
  std::deque<std::vector<CopyOp>> groups;
};

struct Block {
  dim3 grid, dim;
  uint3 idx;
  std::vector<Thread> threads;
  int current = -1;
  ucontext_t scheduler;
  const std::function<void()>* body = nullptr;
  std::string error;
  // [warp][round parity][lane]
  std::vector<uint64_t> slots;
  std::vector<int> live_at_launch;  // lanes per warp at launch
};

Block* g_block = nullptr;

Thread& cur() { return g_block->threads[g_block->current]; }

void yield(int state) {
  Thread& t = cur();
  t.state = state;
  swapcontext(&t.ctx, &g_block->scheduler);
}

void entry() {
  try {
    (*g_block->body)();
  } catch (const std::exception& e) {
    if (g_block->error.empty()) g_block->error = e.what();
  }
  cur().state = kDone;
  swapcontext(&cur().ctx, &g_block->scheduler);
}

void run_block(Block& b) {
  const int n = int(b.dim.x * b.dim.y * b.dim.z);
  b.threads.resize(n);
  const int warps = (n + 31) / 32;
  b.slots.assign(size_t(warps) * 2 * 32, 0);
  b.live_at_launch.assign(warps, 0);
  for (int i = 0; i < n; ++i) {
    Thread& t = b.threads[i];
    t.linear = i;
    t.idx = uint3{unsigned(i % b.dim.x), unsigned(i / b.dim.x % b.dim.y),
                  unsigned(i / (b.dim.x * b.dim.y))};
    static std::vector<std::unique_ptr<char[]>> pool;  // stacks reused by every block
    if (int(pool.size()) <= i) pool.emplace_back(new char[kStack]);
    getcontext(&t.ctx);
    t.ctx.uc_stack.ss_sp = pool[i].get();
    t.ctx.uc_stack.ss_size = kStack;
    t.ctx.uc_link = nullptr;
    makecontext(&t.ctx, entry, 0);
    ++b.live_at_launch[i / 32];
  }
  for (;;) {
    for (int i = 0; i < n; ++i) {
      if (b.threads[i].state != kRunning) continue;
      b.current = i;
      swapcontext(&b.scheduler, &b.threads[i].ctx);
      if (!b.error.empty()) throw std::runtime_error("emu: kernel threw: " + b.error);
    }
    bool all_done = true, released = false;
    bool all_block = true;
    for (auto& t : b.threads) {
      if (t.state != kDone) all_done = false;
      if (t.state != kDone && t.state != kBlock) all_block = false;
    }
    if (all_done) break;
    if (all_block) {
      for (auto& t : b.threads)
        if (t.state == kBlock) t.state = kRunning;
      continue;
    }
    for (int w = 0; w < warps; ++w) {
      bool ready = true, any = false;
      for (int i = w * 32; i < std::min(n, w * 32 + 32); ++i) {
        const int s = b.threads[i].state;
        if (s == kWarp) any = true;
        if (s != kWarp && s != kDone) ready = false;
      }
      if (ready && any) {
        for (int i = w * 32; i < std::min(n, w * 32 + 32); ++i)
          if (b.threads[i].state == kDone)
            throw std::runtime_error("emu: shuffle or __syncwarp in a warp with exited lanes");
        for (int i = w * 32; i < std::min(n, w * 32 + 32); ++i)
          if (b.threads[i].state == kWarp) b.threads[i].state = kRunning;
        released = true;
      }
    }
    if (!released) {
      char msg[256];
      std::snprintf(msg, sizeof msg,
                    "emu: deadlock in block (%u,%u,%u): threads wait at different barriers "
                    "(divergent __syncthreads or shuffle)",
                    b.idx.x, b.idx.y, b.idx.z);
      throw std::runtime_error(msg);
    }
  }
}

}  // namespace

uint3 thread_idx() { return cur().idx; }
uint3 block_idx() { return g_block->idx; }
dim3 block_dim() { return g_block->dim; }
dim3 grid_dim() { return g_block->grid; }
unsigned lane_id() { return unsigned(cur().linear % 32); }
void block_barrier() { yield(kBlock); }
void warp_barrier() { yield(kWarp); }
std::vector<CopyOp>& open_copies() { return cur().open; }
std::deque<std::vector<CopyOp>>& copy_groups() { return cur().groups; }

uint64_t warp_exchange(uint64_t word, int src, bool check_full) {
  Thread& t = cur();
  const int warp = t.linear / 32, lane = t.linear % 32;
  const int parity = int(t.shuffle_round++ & 1);
  uint64_t* slots = &g_block->slots[(size_t(warp) * 2 + parity) * 32];
  slots[lane] = word;
  warp_barrier();
  (void)check_full;
  return slots[src];
}

uint32_t warp_ballot(bool pred) {
  Thread& t = cur();
  const int warp = t.linear / 32;
  const int parity = int(t.shuffle_round & 1);
  warp_exchange(pred ? 1 : 0, t.linear % 32);
  const uint64_t* slots = &g_block->slots[(size_t(warp) * 2 + parity) * 32];
  uint32_t bits = 0;
  const int n = int(g_block->threads.size());
  for (int i = warp * 32; i < std::min(n, warp * 32 + 32); ++i)
    if (slots[i - warp * 32]) bits |= 1u << (i - warp * 32);
  return bits;
}

void warp_gather(uint64_t word, uint64_t (&words)[32]) {
  Thread& t = cur();
  const int warp = t.linear / 32;
  const int parity = int(t.shuffle_round & 1);
  warp_exchange(word, t.linear % 32);
  const uint64_t* slots = &g_block->slots[(size_t(warp) * 2 + parity) * 32];
  const int n = int(g_block->threads.size());
  for (int i = 0; i < 32; ++i) words[i] = warp * 32 + i < n ? slots[i] : 0;
}

long long g_launches = 0;  // kernel launches so far: tests check that the kernel really ran

void run_grid(dim3 grid, dim3 block, const std::function<void()>& body) {
  if (block.x * block.y * block.z > 1024) throw std::runtime_error("emu: block too large");
  ++g_launches;
  for (unsigned z = 0; z < grid.z; ++z)
    for (unsigned y = 0; y < grid.y; ++y)
      for (unsigned x = 0; x < grid.x; ++x) {
        Block b;
        b.grid = grid;
        b.dim = block;
        b.idx = uint3{x, y, z};
        b.body = &body;
        Block* previous = g_block;
        g_block = &b;
        try {
          run_block(b);
        } catch (...) {
          g_block = previous;
          throw;
        }
        g_block = previous;
      }
}

}  // namespace emu

// CUDA runtime stand-ins: one device (0, an sm_90), every pointer is "device memory", no errors.
extern "C" {
long long emu_launch_count(void) { return emu::g_launches; }
cudaError_t cudaGetDevice(int* device) {
  *device = 0;
  return cudaSuccess;
}
cudaError_t cudaSetDevice(int) { return cudaSuccess; }
cudaError_t cudaGetLastError(void) { return cudaSuccess; }
cudaError_t cudaPeekAtLastError(void) { return cudaSuccess; }
cudaError_t cudaGetDeviceCount(int* count) {
  *count = 1;
  return cudaSuccess;
}
const char* cudaGetErrorName(cudaError_t) { return "cudaEmulated"; }
const char* cudaGetErrorString(cudaError_t) { return "emulated"; }
cudaError_t cudaPointerGetAttributes(cudaPointerAttributes* attr, const void*) {
  attr->type = cudaMemoryTypeDevice;
  attr->device = 0;
  return cudaSuccess;
}
cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attr, int) {
  *value = attr == cudaDevAttrMultiProcessorCount       ? 132
           : attr == cudaDevAttrComputeCapabilityMajor ? 9
                                                       : 0;
  return cudaSuccess;
}
cudaError_t cudaFuncSetAttribute(const void*, cudaFuncAttribute, int) { return cudaSuccess; }
}
