//! NUMA: which memory node a GPU sits closest to, and pinned pages placed
//! on a node.
//!
//! - Discovery reads sysfs, as `nvidia-smi topo -m` does: the GPU's PCI
//!   address (from the driver) names `/sys/bus/pci/devices/<addr>/numa_node`
//!   (`-1`: the platform does not say, as in most VMs); the nodes online are
//!   in `/sys/devices/system/node/online`. The readers take the sysfs root,
//!   so tests give them a faked topology.
//! - Placement binds a fresh mapping's pages to the node (`mbind`,
//!   `MPOL_BIND`) before they are first touched, then touches them, so they
//!   are allocated there; the driver pins them in place afterwards.
//! - Checking asks the kernel where each page is (`get_mempolicy` with
//!   `MPOL_F_NODE | MPOL_F_ADDR`), rather than trusting the request.

use crate::base::error::{Error, Result};
use std::path::Path;

/// The real sysfs.
pub(crate) const SYSFS: &str = "/sys";

/// The NUMA nodes online on this host, in order (empty when the kernel
/// does not say, e.g. built without NUMA).
pub fn online_nodes() -> Vec<u32> {
    online_nodes_in(Path::new(SYSFS))
}

/// [`online_nodes`] under another sysfs root.
pub(crate) fn online_nodes_in(root: &Path) -> Vec<u32> {
    std::fs::read_to_string(root.join("devices/system/node/online"))
        .map(|s| parse_list(&s))
        .unwrap_or_default()
}

/// A kernel cpu/node list (`0-3,8,10-11`) as numbers; malformed parts are
/// skipped.
pub(crate) fn parse_list(s: &str) -> Vec<u32> {
    let mut out = Vec::new();
    for part in s.trim().split(',').filter(|p| !p.is_empty()) {
        match part.split_once('-') {
            Some((a, b)) => {
                if let (Ok(a), Ok(b)) = (a.trim().parse::<u32>(), b.trim().parse::<u32>()) {
                    out.extend(a..=b.min(a.saturating_add(4096)));
                }
            }
            None => {
                if let Ok(v) = part.trim().parse() {
                    out.push(v);
                }
            }
        }
    }
    out
}

/// The node of the PCI device `bus_id` (`0000:17:00.0`) under sysfs
/// `root`: `None` when the file is missing or says `-1`.
pub(crate) fn node_of_pci_in(root: &Path, bus_id: &str) -> Option<u32> {
    let path = root
        .join("bus/pci/devices")
        .join(bus_id.to_ascii_lowercase())
        .join("numa_node");
    let v: i64 = std::fs::read_to_string(path).ok()?.trim().parse().ok()?;
    u32::try_from(v).ok()
}

/// `mbind` modes and flags (linux/mempolicy.h).
const MPOL_BIND: libc::c_ulong = 2;
const MPOL_MF_STRICT: libc::c_ulong = 1;
const MPOL_MF_MOVE: libc::c_ulong = 2;
/// `get_mempolicy` flags.
const MPOL_F_NODE: libc::c_ulong = 1;
const MPOL_F_ADDR: libc::c_ulong = 2;
/// Bits in the node masks passed to the kernel (the largest kernels
/// configure 1024 nodes).
const MASK_WORDS: usize = 16;

/// Binds the pages of `ptr..ptr + bytes` to `node`: pages not yet touched
/// are allocated there when first touched; pages already present are moved.
///
/// # Safety
/// `ptr..ptr + bytes` is a page-aligned anonymous mapping of the caller's
/// that nothing else uses.
///
/// # Errors
/// `InvalidArgument` naming the node when the kernel refuses it (a node
/// that does not exist or is offline), or the system error.
pub(crate) unsafe fn bind(ptr: *mut u8, bytes: usize, node: u32) -> Result<()> {
    let mut mask = [0 as libc::c_ulong; MASK_WORDS];
    let bits = libc::c_ulong::BITS as usize;
    let (word, bit) = (node as usize / bits, node as usize % bits);
    if word >= MASK_WORDS {
        return Err(Error::InvalidArgument(format!(
            "NUMA node {node} is beyond the {} nodes a mask holds",
            MASK_WORDS * bits
        )));
    }
    mask[word] = 1 << bit;
    // SAFETY: mbind reads `mask` (MASK_WORDS words, the bit count given
    // plus one, as the kernel expects) and changes only the policy of the
    // caller's range.
    let r = unsafe {
        libc::syscall(
            libc::SYS_mbind,
            ptr,
            bytes,
            MPOL_BIND,
            mask.as_ptr(),
            (MASK_WORDS * bits + 1) as libc::c_ulong,
            MPOL_MF_STRICT | MPOL_MF_MOVE,
        )
    };
    if r != 0 {
        let err = std::io::Error::last_os_error();
        return Err(match err.raw_os_error() {
            Some(libc::EINVAL) | Some(libc::ENODEV) => Error::InvalidArgument(format!(
                "cannot place memory on NUMA node {node} ({err}); nodes online: {:?}",
                online_nodes()
            )),
            _ => err.into(),
        });
    }
    Ok(())
}

/// The node holding the (touched) page at `ptr`.
///
/// # Safety
/// `ptr` lies in a mapping of the caller's.
///
/// # Errors
/// The system error (`ENOSYS` on kernels without NUMA).
pub(crate) unsafe fn node_of_page(ptr: *const u8) -> Result<u32> {
    let mut node: libc::c_int = -1;
    // SAFETY: writes one int; no node mask is asked for (null, 0).
    let r = unsafe {
        libc::syscall(
            libc::SYS_get_mempolicy,
            &mut node as *mut libc::c_int,
            std::ptr::null_mut::<libc::c_ulong>(),
            0 as libc::c_ulong,
            ptr,
            MPOL_F_NODE | MPOL_F_ADDR,
        )
    };
    if r != 0 {
        return Err(std::io::Error::last_os_error().into());
    }
    u32::try_from(node).map_err(|_| Error::Internal(format!("get_mempolicy gave node {node}")))
}

/// The node holding every page of `ptr..ptr + bytes` (the first, then one
/// every 2 MiB, and the last), or `None` when they are on different nodes.
///
/// # Safety
/// `ptr..ptr + bytes` is a mapping of the caller's whose pages are touched.
///
/// # Errors
/// As [`node_of_page`].
pub(crate) unsafe fn node_of_range(ptr: *const u8, bytes: usize) -> Result<Option<u32>> {
    if bytes == 0 {
        return Ok(None);
    }
    let mut offsets: Vec<usize> = (0..bytes).step_by(2 << 20).collect();
    offsets.push(bytes - 1);
    let mut node = None;
    for off in offsets {
        // SAFETY: inside the caller's range.
        let n = unsafe { node_of_page(ptr.add(off)) }?;
        match node {
            None => node = Some(n),
            Some(m) if m != n => return Ok(None),
            Some(_) => {}
        }
    }
    Ok(node)
}

/// A fresh anonymous mapping of `bytes` whose pages are on `node`:
/// bound before they are touched, then touched. Unmapped again on error.
///
/// # Errors
/// As [`bind`]; the system error when the mapping fails.
pub(crate) fn map_on_node(bytes: usize, node: u32) -> Result<*mut u8> {
    let ptr = map_anonymous(bytes)?;
    // SAFETY: the mapping just made, page-aligned, ours alone.
    if let Err(e) = unsafe { bind(ptr, bytes, node) } {
        // SAFETY: the mapping just made.
        unsafe { libc::munmap(ptr.cast(), bytes) };
        return Err(e);
    }
    let page = page_size();
    for off in (0..bytes).step_by(page) {
        // SAFETY: inside the mapping; the first write allocates the page,
        // on `node` (the policy set above).
        unsafe { ptr.add(off).write_volatile(0) };
    }
    Ok(ptr)
}

/// A fresh private anonymous mapping of `bytes` (pages not yet touched),
/// page-aligned; the caller unmaps it.
///
/// # Errors
/// The system error.
pub(crate) fn map_anonymous(bytes: usize) -> std::io::Result<*mut u8> {
    // SAFETY: anonymous private mapping; no address hint.
    let ptr = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            bytes,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    if ptr == libc::MAP_FAILED {
        return Err(std::io::Error::last_os_error());
    }
    Ok(ptr.cast())
}

/// The CPUs of NUMA node `node` (empty when unknown).
pub(crate) fn cpus_of_node(node: u32) -> Vec<u32> {
    std::fs::read_to_string(format!("{SYSFS}/devices/system/node/node{node}/cpulist"))
        .map(|s| parse_list(&s))
        .unwrap_or_default()
}

/// Restricts the calling thread to `cpus` (nothing when empty, or when the
/// system refuses: placement is an optimisation).
pub(crate) fn run_on_cpus(cpus: &[u32]) {
    if cpus.is_empty() {
        return;
    }
    // SAFETY: a zeroed cpu_set_t is a valid empty set; CPU_SET writes
    // inside it for indices below CPU_SETSIZE (checked).
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        for &c in cpus
            .iter()
            .filter(|&&c| (c as usize) < libc::CPU_SETSIZE as usize)
        {
            libc::CPU_SET(c as usize, &mut set);
        }
        libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set);
    }
}

/// The system's page size.
pub(crate) fn page_size() -> usize {
    // SAFETY: sysconf has no preconditions.
    unsafe { libc::sysconf(libc::_SC_PAGESIZE) }.max(4096) as usize
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn node_lists_parse_as_the_kernel_writes_them() {
        assert_eq!(parse_list("0\n"), vec![0]);
        assert_eq!(parse_list("0-3,8,10-11\n"), vec![0, 1, 2, 3, 8, 10, 11]);
        assert_eq!(parse_list(""), Vec::<u32>::new());
        assert_eq!(parse_list("x,2"), vec![2]);
    }

    #[test]
    fn a_faked_sysfs_gives_each_gpu_its_node() {
        let root = std::env::temp_dir().join(format!("host-numa-{}", std::process::id()));
        let dev = |id: &str, node: &str| {
            let d = root.join("bus/pci/devices").join(id);
            std::fs::create_dir_all(&d).unwrap();
            std::fs::write(d.join("numa_node"), node).unwrap();
        };
        dev("0000:17:00.0", "0\n");
        dev("0000:ca:00.0", "1\n");
        dev("0000:03:00.0", "-1\n");
        std::fs::create_dir_all(root.join("devices/system/node")).unwrap();
        std::fs::write(root.join("devices/system/node/online"), "0-1\n").unwrap();
        assert_eq!(online_nodes_in(&root), vec![0, 1]);
        assert_eq!(node_of_pci_in(&root, "0000:17:00.0"), Some(0));
        // Upper case, as cuDeviceGetPCIBusId may write it.
        assert_eq!(node_of_pci_in(&root, "0000:CA:00.0"), Some(1));
        assert_eq!(node_of_pci_in(&root, "0000:03:00.0"), None);
        assert_eq!(node_of_pci_in(&root, "0000:99:00.0"), None);
        std::fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn pages_mapped_on_a_node_are_found_there() {
        let Some(&node) = online_nodes().first() else {
            // No node to map on: only where the kernel has no NUMA list at
            // all, and then a request for node 0 is refused, not ignored.
            let list = Path::new(SYSFS).join("devices/system/node/online");
            assert!(
                !list.exists(),
                "{} exists but gave no NUMA node",
                list.display()
            );
            assert!(map_on_node(1 << 20, 0).is_err());
            return;
        };
        let bytes = 8 << 20;
        let ptr = map_on_node(bytes, node).unwrap();
        // SAFETY: the mapping above, touched by map_on_node.
        let found = unsafe { node_of_range(ptr, bytes) }.unwrap();
        assert_eq!(found, Some(node));
        // SAFETY: our mapping, no longer used.
        unsafe { libc::munmap(ptr.cast(), bytes) };
    }

    #[test]
    fn a_node_that_is_not_there_is_refused_by_name() {
        let missing = online_nodes().iter().max().map_or(1, |m| m + 1);
        let err = map_on_node(1 << 20, missing).unwrap_err();
        assert!(
            matches!(&err, Error::InvalidArgument(m) if m.contains(&format!("node {missing}"))),
            "{err}"
        );
    }
}
