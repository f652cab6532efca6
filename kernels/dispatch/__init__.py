"""The user-facing calls: validation, the warm dispatch table, the cold path (memory, store, tune), dynamic shapes."""
