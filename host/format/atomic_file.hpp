// Atomic file replacement: bytes go to a temporary name in the target's folder, are fsynced,
// renamed over the target, and the folder is fsynced so the new name survives a crash. A
// reader sees the old file or the new one, never a torn one; on failure the target is
// untouched and the temporary removed.
#pragma once
#include <cstdint>
#include <functional>
#include <span>
#include <string>

namespace deltasync {

// Writes the concatenation of `pieces` to `path` atomically. Throws Error("PATH: reason").
void write_file_atomic(const std::string& path, std::span<const std::span<const uint8_t>> pieces);

// Streams into `path` atomically: `produce(write)` calls write(bytes) as often as it likes.
void write_file_atomic(const std::string& path,
                       const std::function<void(const std::function<void(std::span<const uint8_t>)>&)>& produce);

// A fresh "<path>.tmp.<random>" name in the same folder.
std::string temporary_name_for(const std::string& path);

// fsync of the folder holding `path` (makes a rename or link durable).
void sync_parent_folder(const std::string& path);

}  // namespace deltasync
