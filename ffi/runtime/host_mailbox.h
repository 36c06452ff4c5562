// The host mailbox: a shared-memory page of this host's PEs, through which each PE posts, per
// call that needs it, what only its host knows (the addresses XLA gave the call's outputs) and
// reads its peers' posts. The copy engines are programmed on the host, so a transfer straight
// into a peer's XLA output needs that address there (docs/design.md, section 4.3).
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <vector>

namespace jax_ep {

// What a PE posts for one exchange.
using HostPost = std::array<uint64_t, 2>;

// Maps the mailbox `name` (a POSIX shared-memory object, created by whichever PE of the host
// comes first) for `num_pes` PEs; throws with the reason where it cannot.
void open_host_mailbox(const std::string& name, int num_pes);
// Removes the name (the mappings stay); every PE has opened it first.
void unlink_host_mailbox(const std::string& name);
void close_host_mailbox();
bool host_mailbox_open();

// Posts `mine` as PE `me`'s next exchange and waits until every PE of `peers` has posted its
// exchange of the same number (the PEs of a group run the same calls, so their counts agree);
// their posts in `theirs`, in `peers`' order. Returns "" or what went wrong, naming the PE
// that did not post within timeout_s.
std::string exchange_on_host(int me, const std::vector<int>& peers, const HostPost& mine,
                             std::vector<HostPost>* theirs, double timeout_s);

}  // namespace jax_ep
