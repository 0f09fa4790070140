//! What the types guarantee (placeholder, filled below).
