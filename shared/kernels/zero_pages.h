// Zeros for large CPU buffers, for the bindings of the row kernel's library. A fresh weight gradient is mostly the
// zero rows of idle experts, and writing them costs a page fault and a kernel-side clear for every 4 KB, then the
// write itself. ZeroBytes instead releases the pages of the range that are not in memory (madvise MADV_DONTNEED):
// they then read as zeros and take memory again only where something writes them. Pages in memory (a buffer on
// memory the allocator kept from an earlier one: glibc told to keep freed blocks, torch's page pool) are written:
// released, they would fault again at the next write. Only the partial pages at the range's ends are always
// written. Releasing holds for private anonymous memory only (a file mapping would read the file back), so the
// range's mappings are looked up in /proc/self/maps first, and anything else is written with memset.
#pragma once

#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <vector>

namespace moe_rows {

constexpr size_t kReleaseFromBytes = size_t{4} << 20;  // smaller ranges are written (the lookup costs more)

// Whether [begin, end) lies in consecutive private anonymous mappings of this process (no file, not shared)
inline bool PrivateAnonymous(uintptr_t begin, uintptr_t end) {
  FILE* maps = std::fopen("/proc/self/maps", "r");
  if (maps == nullptr) return false;
  char line[4096];
  uintptr_t covered = begin;  // [begin, covered) is known to be private anonymous
  bool broken = false;
  while (!broken && covered < end && std::fgets(line, sizeof line, maps) != nullptr) {
    unsigned long lo = 0, hi = 0, offset = 0, inode = 0;
    unsigned major = 0, minor = 0;
    char perms[8] = {};
    int path_at = 0;
    if (std::sscanf(line, "%lx-%lx %7s %lx %x:%x %lu %n", &lo, &hi, perms, &offset, &major, &minor, &inode,
                    &path_at) < 7)
      continue;
    if (hi <= covered) continue;
    const char* path = line + path_at;
    const bool anonymous = inode == 0 && perms[3] == 'p' &&
                           (*path == '\0' || *path == '\n' || std::strncmp(path, "[heap]", 6) == 0);
    if (lo > covered || !anonymous) {
      broken = true;
    } else {
      covered = hi;
    }
  }
  std::fclose(maps);
  return !broken && covered >= end;
}

// Maps the pages of [data, data + bytes) writable ahead of writing them (madvise MADV_POPULATE_WRITE, Linux 5.14 and
// later; their contents stay as they are): one call instead of a fault per 4 KB page where a fresh buffer is about to
// be written whole (on this project's 2-core VM, 100 MB of fresh pages: 52-67 ms written, 33 ms populated then 4
// written). A hint: where the kernel does not take it, the writes fault as before.
inline void PopulateForWriting(void* data, size_t bytes) {
  constexpr int kPopulateWrite = 23;  // MADV_POPULATE_WRITE, absent from older headers
  const auto begin = reinterpret_cast<uintptr_t>(data);
  const auto page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  const uintptr_t start = begin / page * page, end = (begin + bytes + page - 1) / page * page;
  if (bytes > 0) madvise(reinterpret_cast<void*>(start), end - start, kPopulateWrite);
}

// Zeros the whole pages [start, end) of private anonymous memory: each run of pages in memory (mincore) written,
// each run of the others released
inline void ZeroWholePages(uintptr_t start, uintptr_t end, uintptr_t page) {
  const size_t pages = (end - start) / page;
  std::vector<unsigned char> in_memory(pages, 0);
  if (mincore(reinterpret_cast<void*>(start), end - start, in_memory.data()) != 0) in_memory.assign(pages, 0);
  for (size_t i = 0; i < pages;) {
    const bool resident = in_memory[i] & 1;
    size_t j = i + 1;
    while (j < pages && static_cast<bool>(in_memory[j] & 1) == resident) ++j;
    void* at = reinterpret_cast<void*>(start + i * page);
    const size_t bytes = (j - i) * page;
    if (resident || madvise(at, bytes, MADV_DONTNEED) != 0) std::memset(at, 0, bytes);
    i = j;
  }
}

// Zeros [data, data + bytes); `releasable`: whether its whole pages may be released (Releasable; a caller zeroing
// several ranges of one buffer looks that up once, for the whole buffer)
inline void ZeroBytes(void* data, size_t bytes, bool releasable) {
  const auto begin = reinterpret_cast<uintptr_t>(data);
  const auto page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  const uintptr_t start = (begin + page - 1) / page * page, end = (begin + bytes) / page * page;
  if (!releasable || end <= start) {
    std::memset(data, 0, bytes);
    return;
  }
  std::memset(data, 0, start - begin);
  std::memset(reinterpret_cast<void*>(end), 0, begin + bytes - end);
  ZeroWholePages(start, end, page);
}

// Whether the whole pages of [data, data + bytes) may be released (private anonymous memory, kReleaseFromBytes on)
inline bool Releasable(const void* data, size_t bytes) {
  const auto begin = reinterpret_cast<uintptr_t>(data);
  const auto page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  const uintptr_t start = (begin + page - 1) / page * page, end = (begin + bytes) / page * page;
  return bytes >= kReleaseFromBytes && end > start && PrivateAnonymous(start, end);
}

inline void ZeroBytes(void* data, size_t bytes) { ZeroBytes(data, bytes, Releasable(data, bytes)); }

}  // namespace moe_rows
