"""What persists between processes: selections (and dynamic-shape bucket decisions) on disk, locked and published
atomically."""
