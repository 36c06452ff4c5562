#include "runtime/host_mailbox.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <mutex>
#include <stdexcept>
#include <thread>

namespace jax_ep {
namespace {

// Exchanges kept per PE: a PE posts exchange n + 1 only after reading every peer's post n,
// which those peers made after reading its own post n - 1, so two slots never overwrite an
// unread post; four leave room.
constexpr int kSlots = 4;

struct Post {
  std::atomic<uint64_t> number;  // 0: nothing posted yet (the object starts zeroed)
  uint64_t values[2];
};
static_assert(std::atomic<uint64_t>::is_always_lock_free, "posts are shared between processes");

std::mutex g_mailbox_mutex;
Post* g_posts = nullptr;  // [num_pes][kSlots]
size_t g_bytes = 0;
int g_num_pes = 0;
uint64_t g_exchanges = 0;  // this PE's exchanges so far

[[noreturn]] void fail(const std::string& message) {
  throw std::runtime_error("jax_ep host mailbox: " + message);
}

}  // namespace

void open_host_mailbox(const std::string& name, int num_pes) {
  std::lock_guard<std::mutex> lock(g_mailbox_mutex);
  if (g_posts != nullptr) fail("already open");
  if (num_pes <= 0) fail("needs at least one PE");
  const size_t bytes = sizeof(Post) * kSlots * size_t(num_pes);
  const int fd = shm_open(name.c_str(), O_CREAT | O_RDWR, 0600);
  if (fd < 0) fail("shm_open(" + name + "): " + std::strerror(errno));
  // every PE sizes it alike; the pages a later ftruncate keeps stay as they are
  if (ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
    const int err = errno;
    close(fd);
    fail("ftruncate(" + name + "): " + std::strerror(err));
  }
  void* at = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  const int err = errno;
  close(fd);
  if (at == MAP_FAILED) fail("mmap(" + name + "): " + std::strerror(err));
  g_posts = static_cast<Post*>(at);
  g_bytes = bytes;
  g_num_pes = num_pes;
  g_exchanges = 0;
}

void unlink_host_mailbox(const std::string& name) {
  if (shm_unlink(name.c_str()) != 0 && errno != ENOENT)
    fail("shm_unlink(" + name + "): " + std::strerror(errno));
}

void close_host_mailbox() {
  std::lock_guard<std::mutex> lock(g_mailbox_mutex);
  if (g_posts != nullptr) munmap(g_posts, g_bytes);
  g_posts = nullptr;
  g_bytes = 0;
  g_num_pes = 0;
}

bool host_mailbox_open() {
  std::lock_guard<std::mutex> lock(g_mailbox_mutex);
  return g_posts != nullptr;
}

std::string exchange_on_host(int me, const std::vector<int>& peers, const HostPost& mine,
                             std::vector<HostPost>* theirs, double timeout_s) {
  std::lock_guard<std::mutex> lock(g_mailbox_mutex);
  if (g_posts == nullptr) return "the host mailbox is not open";
  if (me < 0 || me >= g_num_pes) return "PE " + std::to_string(me) + " has no mailbox slot";
  const uint64_t n = ++g_exchanges;
  Post& post = g_posts[size_t(me) * kSlots + n % kSlots];
  post.values[0] = mine[0];
  post.values[1] = mine[1];
  post.number.store(n, std::memory_order_release);
  theirs->assign(peers.size(), HostPost{0, 0});
  const auto deadline = std::chrono::steady_clock::now() +
                        std::chrono::duration<double>(timeout_s > 0 ? timeout_s : 100.0);
  for (size_t i = 0; i < peers.size(); ++i) {
    const int pe = peers[i];
    if (pe < 0 || pe >= g_num_pes) return "PE " + std::to_string(pe) + " has no mailbox slot";
    const Post& their = g_posts[size_t(pe) * kSlots + n % kSlots];
    for (int spins = 0;; ++spins) {
      const uint64_t seen = their.number.load(std::memory_order_acquire);
      if (seen == n) break;
      if (seen > n)
        return "PE " + std::to_string(pe) + " is at exchange " + std::to_string(seen) +
               ", this PE at " + std::to_string(n) + ": the PEs ran different calls";
      if (spins > 1000) {
        if (std::chrono::steady_clock::now() > deadline)
          return "PE " + std::to_string(pe) + " did not post its output addresses for exchange " +
                 std::to_string(n) + " within " + std::to_string(timeout_s) + " s";
        std::this_thread::yield();
      }
    }
    (*theirs)[i] = HostPost{their.values[0], their.values[1]};
  }
  return "";
}

}  // namespace jax_ep
