"""The parts a table server composes for long-lived tables: admission (a counting sketch),
eviction and delta checkpoints. They import only row storage and initial rows."""
