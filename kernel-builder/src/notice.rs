//! A status line shown while the build script runs.

/// One status line on the stream cargo writes its own status to, shown when
/// it is written. A build script cannot do that through cargo:
/// `cargo:warning=` lines appear only after the script has finished, and
/// cargo replays them on every later build, no-op ones included. So the line
/// goes to cargo's own stderr (`/proc/<cargo>/fd/2`) when that is a terminal
/// or a pipe (a CI log); when it is a file, or off Linux, nothing is shown.
pub fn notice(line: &str) {
    #[cfg(target_os = "linux")]
    {
        use std::io::Write;
        let fd = format!("/proc/{}/fd/2", std::os::unix::process::parent_id());
        let Ok(link) = std::fs::read_link(&fd) else {
            return;
        };
        let link = link.to_string_lossy();
        let tty = link.starts_with("/dev/pts/") || link.starts_with("/dev/tty");
        if !tty && !link.starts_with("pipe:") {
            return;
        }
        if let Ok(mut stderr) = std::fs::OpenOptions::new().append(true).open(&fd) {
            // On a terminal, over cargo's progress bar; cargo redraws it below.
            let clear = if tty { "\r\x1b[2K" } else { "" };
            let _ = stderr.write_all(format!("{clear}{line}\n").as_bytes());
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = line;
}

/// The announcement of a first (slow) build: `core` is compiled for the GPU.
pub(crate) fn first_build_line(krate: &str, arch: &str) -> String {
    format!(
        "{:>12} GPU kernels of {krate} for nvptx64-nvidia-cuda ({arch}); the first build takes a minute or two",
        "Compiling"
    )
}
