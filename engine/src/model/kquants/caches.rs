//! The data caches of the CPU the kernels run on, read once at start, so that blocking is
//! sized from this machine's caches rather than from constants tuned on another.
//!
//! Linux's sysfs first (cpu0's caches: on a hybrid CPU a performance core's, whichever core
//! asks), then on x86 the two CPUID leaves that describe the caches (Intel's 4, AMD's and
//! Hygon's 0x8000001D, one format), which work on every OS. Written by hand: both are a few
//! lines (CPUID over std's `__cpuid_count`), and the crates that do this (`cache-size`,
//! `raw-cpuid`) are x86-only, so ARM would need the sysfs reader anyway.

use std::sync::OnceLock;

/// The data caches as one core sees them, in bytes (0: not reported); each cache's whole
/// size, shared or not (an L3 is shared by many cores, on some ARM chips an L2 too).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Caches {
    pub l1d: usize,
    pub l2: usize,
    pub l3: usize,
}

impl Caches {
    /// Level `level`'s size, when reported.
    fn set(&mut self, level: u32, bytes: usize) {
        match level {
            1 => self.l1d = bytes,
            2 => self.l2 = bytes,
            3 => self.l3 = bytes,
            _ => {}
        }
    }

    /// As one line: `L1d 32 KiB, L2 1 MiB, L3 32 MiB` (levels not reported left out).
    pub fn describe(&self) -> String {
        let parts: Vec<String> = [("L1d", self.l1d), ("L2", self.l2), ("L3", self.l3)]
            .iter()
            .filter(|(_, b)| *b > 0)
            .map(|(name, b)| format!("{name} {}", human(*b)))
            .collect();
        if parts.is_empty() {
            "not reported".to_string()
        } else {
            parts.join(", ")
        }
    }
}

fn human(bytes: usize) -> String {
    if bytes >= 1 << 20 && bytes.is_multiple_of(1 << 20) {
        format!("{} MiB", bytes >> 20)
    } else {
        format!("{} KiB", bytes >> 10)
    }
}

/// This CPU's caches (the first call reads them).
pub fn caches() -> Caches {
    static CACHES: OnceLock<Caches> = OnceLock::new();
    *CACHES.get_or_init(detect)
}

fn detect() -> Caches {
    let sysfs = from_sysfs(std::path::Path::new(SYSFS_CPU0)).unwrap_or_default();
    #[cfg(target_arch = "x86_64")]
    if sysfs.l2 == 0 {
        return from_cpuid();
    }
    sysfs
}

/// Where Linux describes cpu0's caches.
const SYSFS_CPU0: &str = "/sys/devices/system/cpu/cpu0/cache";

/// The data and unified caches CPUID describes: leaf 4 on Intel, 0x8000001D on AMD (with
/// topology extensions), whose sub-leaves each give one cache's type, level and geometry.
#[cfg(target_arch = "x86_64")]
fn from_cpuid() -> Caches {
    use std::arch::x86_64::__cpuid_count;
    let mut c = Caches::default();
    let vendor = super::cpu_vendor();
    let leaf = if &vendor == b"AuthenticAMD" || &vendor == b"HygonGenuine" {
        // Leaf 0x80000000: the highest extended leaf; 0x80000001 ECX bit 22: topology
        // extensions, which bring leaf 0x8000001D.
        let max = __cpuid_count(0x8000_0000, 0).eax;
        let topoext = max >= 0x8000_001D && __cpuid_count(0x8000_0001, 0).ecx & (1 << 22) != 0;
        if !topoext {
            return c;
        }
        0x8000_001D
    } else {
        // Leaf 0's EAX: the highest standard leaf.
        if __cpuid_count(0, 0).eax < 4 {
            return c;
        }
        4
    };
    for sub in 0..16 {
        // Sub-leaves past the last cache report type 0.
        let r = __cpuid_count(leaf, sub);
        let kind = r.eax & 0x1f;
        if kind == 0 {
            break;
        }
        // 1: data, 3: unified (2, instructions, is not ours).
        if kind == 1 || kind == 3 {
            c.set((r.eax >> 5) & 0x7, geometry_bytes(r.ebx, r.ecx));
        }
    }
    c
}

/// A cache's size from CPUID's EBX (ways, partitions and line size, each minus one) and ECX
/// (sets minus one).
#[cfg(any(target_arch = "x86_64", test))]
fn geometry_bytes(ebx: u32, ecx: u32) -> usize {
    let ways = ((ebx >> 22) & 0x3ff) as usize + 1;
    let partitions = ((ebx >> 12) & 0x3ff) as usize + 1;
    let line = (ebx & 0xfff) as usize + 1;
    let sets = ecx as usize + 1;
    ways.saturating_mul(partitions)
        .saturating_mul(line)
        .saturating_mul(sets)
}

/// Linux's view of cpu0's caches (`index*/level`, `type`, `size` such as `512K`).
fn from_sysfs(dir: &std::path::Path) -> Option<Caches> {
    let read = |p: std::path::PathBuf| std::fs::read_to_string(p).ok();
    let mut c = Caches::default();
    for entry in std::fs::read_dir(dir).ok()?.flatten() {
        let p = entry.path();
        if !entry.file_name().to_string_lossy().starts_with("index") {
            continue;
        }
        let kind = read(p.join("type")).unwrap_or_default();
        if kind.trim() == "Instruction" {
            continue;
        }
        let level = read(p.join("level")).and_then(|s| s.trim().parse::<u32>().ok());
        let size = read(p.join("size")).and_then(|s| parse_size(&s));
        if let (Some(level), Some(size)) = (level, size) {
            c.set(level, size);
        }
    }
    Some(c)
}

/// sysfs's `512K`, `32768K`, `1M`, or plain bytes.
fn parse_size(s: &str) -> Option<usize> {
    let s = s.trim();
    let (num, mult) = match s.char_indices().last()? {
        (i, 'K') => (&s[..i], 1 << 10),
        (i, 'M') => (&s[..i], 1 << 20),
        (i, 'G') => (&s[..i], 1 << 30),
        _ => (s, 1),
    };
    num.parse::<usize>().ok().map(|n| n.saturating_mul(mult))
}

/// The most bytes of a run's tiles that the 256-bit kernels' later passes read without
/// prefetching (`avx2.rs`): half of one core's L2, the rest left to the activations and
/// the next run's first tiles. Unknown L2: 128 KiB, half the smallest of AVX2 CPUs (256 KiB:
/// Haswell to Comet Lake). Bounded to 64 KiB..=2 MiB against a hypervisor's odd report.
pub fn near_run_bytes() -> usize {
    static NEAR: OnceLock<usize> = OnceLock::new();
    *NEAR.get_or_init(|| match caches().l2 {
        0 => 128 << 10,
        l2 => (l2 / 2).clamp(64 << 10, 2 << 20),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse() {
        assert_eq!(parse_size("512K\n"), Some(512 << 10));
        assert_eq!(parse_size("32768K"), Some(32 << 20));
        assert_eq!(parse_size("1M"), Some(1 << 20));
        assert_eq!(parse_size("4096"), Some(4096));
        assert_eq!(parse_size("K"), None);
        assert_eq!(parse_size(""), None);
        assert_eq!(parse_size("lots"), None);
    }

    #[test]
    fn cpuid_geometry() {
        // Zen 3's L2: 8 ways, 1 partition, 64-byte lines, 1024 sets = 512 KiB.
        let ebx = (7 << 22) | 63;
        assert_eq!(geometry_bytes(ebx, 1023), 512 << 10);
    }

    #[test]
    fn sysfs_tree() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("cache");
        for (i, level, kind, size) in [
            (0, "1", "Data", "32K"),
            (1, "1", "Instruction", "64K"),
            (2, "2", "Unified", "1024K"),
            (3, "3", "Unified", "32768K"),
        ] {
            let d = dir.join(format!("index{i}"));
            std::fs::create_dir_all(&d).unwrap();
            std::fs::write(d.join("level"), level).unwrap();
            std::fs::write(d.join("type"), kind).unwrap();
            std::fs::write(d.join("size"), size).unwrap();
        }
        std::fs::create_dir_all(dir.join("power")).unwrap();
        let c = from_sysfs(&dir).unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
        assert_eq!(
            c,
            Caches {
                l1d: 32 << 10,
                l2: 1 << 20,
                l3: 32 << 20
            }
        );
        assert_eq!(c.describe(), "L1d 32 KiB, L2 1 MiB, L3 32 MiB");
        assert_eq!(Caches::default().describe(), "not reported");
        assert!(from_sysfs(&dir).is_none());
    }

    /// What this machine reports, through sysfs and through CPUID alike, is a cache hierarchy:
    /// sizes of real caches, growing level by level (a misread field of CPUID's would give
    /// sizes off by powers of two or more). The two are not compared: on a hybrid CPU CPUID
    /// answers for whichever core runs it.
    #[test]
    fn this_cpu() {
        let hierarchy = |c: Caches| {
            let plausible = |b: usize| b == 0 || (4 << 10..=1 << 30).contains(&b);
            assert!(
                plausible(c.l1d) && plausible(c.l2) && plausible(c.l3),
                "{c:?}"
            );
            if c.l1d > 0 && c.l2 > 0 {
                assert!(c.l1d < c.l2, "{c:?}");
            }
            if c.l2 > 0 && c.l3 > 0 {
                assert!(c.l2 <= c.l3, "{c:?}");
            }
        };
        println!("caches: {}", caches().describe());
        hierarchy(caches());
        #[cfg(target_arch = "x86_64")]
        {
            println!("CPUID: {}", from_cpuid().describe());
            hierarchy(from_cpuid());
        }
        assert!((64 << 10..=2 << 20).contains(&near_run_bytes()));
    }
}
