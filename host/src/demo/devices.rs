//! `host topology`: the machine's devices and how they
//! connect (what `nvidia-smi topo -m` shows: PCIe link, NUMA node, peer
//! access). `host multi-gpu` (multi_gpu.rs) measures what they do.

use super::report::Meta;
use gpufeed::{Device, Error, Result};
use serde::Serialize;
use std::path::Path;

/// A PCIe link as sysfs reports it.
#[derive(Clone, Debug, Serialize)]
pub struct Link {
    pub generation: Option<u32>,
    pub width: Option<u32>,
    pub max_generation: Option<u32>,
    pub max_width: Option<u32>,
}

/// One device of the machine.
#[derive(Clone, Debug, Serialize)]
pub struct DeviceTopo {
    pub ordinal: usize,
    pub name: String,
    pub pci_bus_id: Option<String>,
    pub link: Option<Link>,
    pub numa_node: Option<u32>,
    /// Copies to each device (by ordinal) go directly (peer access).
    pub peer_direct: Vec<bool>,
}

#[derive(Serialize)]
pub struct Topology {
    pub meta: Meta,
    /// NUMA nodes the host has online.
    pub host_numa_nodes: Vec<u32>,
    pub devices: Vec<DeviceTopo>,
}

/// The PCIe generation of a link speed as sysfs writes it (`32.0 GT/s PCIe`).
fn generation(speed: &str) -> Option<u32> {
    let gt: f64 = speed.split_whitespace().next()?.parse().ok()?;
    [
        (2.5, 1),
        (5.0, 2),
        (8.0, 3),
        (16.0, 4),
        (32.0, 5),
        (64.0, 6),
    ]
    .iter()
    .find(|(s, _)| (gt - s).abs() < 0.1)
    .map(|&(_, g)| g)
}

fn link(bus_id: &str) -> Option<Link> {
    let dir = Path::new("/sys/bus/pci/devices").join(bus_id);
    let read = |f: &str| std::fs::read_to_string(dir.join(f)).ok();
    let num = |f: &str| read(f).and_then(|s| s.trim().parse().ok());
    let gen = |f: &str| read(f).and_then(|s| generation(&s));
    let l = Link {
        generation: gen("current_link_speed"),
        width: num("current_link_width"),
        max_generation: gen("max_link_speed"),
        max_width: num("max_link_width"),
    };
    (l.generation.is_some() || l.width.is_some()).then_some(l)
}

/// The topology of `devices` (which [`Device::all`] opened).
pub fn topology(devices: &[Device]) -> Result<Topology> {
    let mut out = Vec::new();
    for d in devices {
        let bus = d.pci_bus_id();
        let peer_direct = devices
            .iter()
            .map(|e| d.enable_peer_access(e))
            .collect::<Result<_>>()?;
        out.push(DeviceTopo {
            ordinal: d.ordinal(),
            name: d.info().name.clone(),
            link: bus.as_deref().and_then(link),
            pci_bus_id: bus,
            numa_node: d.numa_node(),
            peer_direct,
        });
    }
    let first = devices
        .first()
        .ok_or_else(|| Error::InvalidArgument("no device".into()))?;
    Ok(Topology {
        meta: Meta::new(first),
        host_numa_nodes: gpufeed::online_nodes(),
        devices: out,
    })
}

pub fn print_topology(t: &Topology) {
    let opt = |v: Option<u32>| v.map_or("?".to_string(), |v| v.to_string());
    println!(
        "host NUMA nodes online: {}",
        if t.host_numa_nodes.is_empty() {
            "none reported".to_string()
        } else {
            format!("{:?}", t.host_numa_nodes)
        }
    );
    for d in &t.devices {
        let link = d
            .link
            .as_ref()
            .map_or("PCIe link: not reported".to_string(), |l| {
                format!(
                    "PCIe Gen{} x{} (max Gen{} x{})",
                    opt(l.generation),
                    opt(l.width),
                    opt(l.max_generation),
                    opt(l.max_width)
                )
            });
        println!(
            "device {}: {} — {} — {} — NUMA node {}",
            d.ordinal,
            d.name,
            d.pci_bus_id.as_deref().unwrap_or("no PCI address"),
            link,
            d.numa_node
                .map_or("not reported (one node, or a VM)".to_string(), |n| n
                    .to_string())
        );
    }
    if t.devices.len() > 1 {
        print!("peer copies   ");
        for d in &t.devices {
            print!(" dev{:<3}", d.ordinal);
        }
        println!();
        for d in &t.devices {
            print!("  from dev{:<3}", d.ordinal);
            for (j, direct) in d.peer_direct.iter().enumerate() {
                let cell = if j == d.ordinal {
                    "  -   "
                } else if *direct {
                    "direct"
                } else {
                    "staged"
                };
                print!(" {cell}");
            }
            println!();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::generation;

    #[test]
    fn link_speeds_name_their_generation() {
        assert_eq!(generation("32.0 GT/s PCIe\n"), Some(5));
        assert_eq!(generation("16.0 GT/s PCIe"), Some(4));
        assert_eq!(generation("2.5 GT/s PCIe"), Some(1));
        assert_eq!(generation("Unknown"), None);
    }
}
