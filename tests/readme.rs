//! The README's library snippets are the ones `examples/03_readme.rs` runs
//! (CI runs every example on the CPU emulation): each ```rust block of
//! README.md that uses the library appears there verbatim (indentation
//! aside), between `// README snippet` and `// end of snippet`. The blocks
//! of a kernel crate of your own (`kernels!`, a `build.rs`, a `main.rs`
//! over `OUT_DIR`'s PTX) are a separate project's files, left out.

/// The ```rust blocks of `text`, each as its lines, leading whitespace
/// trimmed.
fn rust_blocks(text: &str) -> Vec<Vec<String>> {
    let mut out = Vec::new();
    let mut block: Option<Vec<String>> = None;
    for line in text.lines() {
        match (&mut block, line.trim_end()) {
            (None, "```rust") => block = Some(Vec::new()),
            (Some(_), "```") => out.extend(block.take()),
            (Some(b), l) => b.push(l.trim_start().to_string()),
            (None, _) => {}
        }
    }
    out
}

/// The `// README snippet` sections of the example, as `rust_blocks`.
fn example_snippets(text: &str) -> Vec<Vec<String>> {
    let mut out = Vec::new();
    let mut block: Option<Vec<String>> = None;
    for line in text.lines() {
        match (&mut block, line.trim()) {
            (None, "// README snippet") => block = Some(Vec::new()),
            (Some(_), "// end of snippet") => out.extend(block.take()),
            (Some(b), _) => b.push(line.trim().to_string()),
            (None, _) => {}
        }
    }
    out
}

#[test]
fn every_library_snippet_of_the_readme_is_one_the_example_runs() {
    let root = env!("CARGO_MANIFEST_DIR");
    let readme = std::fs::read_to_string(format!("{root}/README.md")).unwrap();
    let example = std::fs::read_to_string(format!("{root}/examples/03_readme.rs")).unwrap();
    let library: Vec<Vec<String>> = rust_blocks(&readme)
        .into_iter()
        .filter(|b| {
            !b.iter().any(|l| {
                l.starts_with("kernels!")
                    || l.contains("kernel_builder::Builder")
                    || l.contains("env!(\"OUT_DIR\")")
            })
        })
        .map(|b| b.into_iter().filter(|l| !l.is_empty()).collect())
        .collect();
    let snippets: Vec<Vec<String>> = example_snippets(&example)
        .into_iter()
        .map(|b| b.into_iter().filter(|l| !l.is_empty()).collect())
        .collect();
    assert_eq!(
        library.len(),
        5,
        "README.md's library snippets: {library:#?}"
    );
    assert_eq!(
        library, snippets,
        "README.md's library snippets and examples/03_readme.rs's differ: edit both"
    );
    // The kernel-crate blocks are still there (3), and left out above.
    assert_eq!(rust_blocks(&readme).len(), library.len() + 3);
}
