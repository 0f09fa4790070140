//! The parameter lists of a PTX module's entry points, read from its text:
//! what [`Module::function`](crate::Module::function) compares a kernel
//! declaration with (a declaration is tied to an entry by name only; an
//! entry of that name with other parameters would read them wrong). Read
//! from the text rather than asked of the driver: `cuFuncGetParamInfo` has
//! no way to count parameters short of failing past the last one, which
//! compute-sanitizer reports as an error (and `cuFuncGetParamCount` needs
//! CUDA 13.2).

use std::collections::HashMap;

/// Each entry point's parameter sizes in bytes, in order. Entries whose
/// parameter list does not parse are left out (the driver's lookup still
/// decides whether they exist).
pub(crate) fn entry_params(ptx: &str) -> HashMap<String, Vec<usize>> {
    let mut out = HashMap::new();
    let mut rest = ptx;
    while let Some(at) = rest.find(".entry") {
        rest = &rest[at + ".entry".len()..];
        let Some(open) = rest.find('(') else { break };
        let Some(len) = rest[open..].find(')') else {
            break;
        };
        let name = rest[..open].trim();
        let list = &rest[open + 1..open + len];
        rest = &rest[open + len..];
        let valid_name = !name.is_empty()
            && name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '$');
        if !valid_name {
            continue;
        }
        let sizes: Option<Vec<usize>> = list
            .split(',')
            .map(str::trim)
            .filter(|p| !p.is_empty())
            .map(param_size)
            .collect();
        if let Some(sizes) = sizes {
            out.insert(name.to_string(), sizes);
        }
    }
    out
}

/// The size of one `.param [.align N] [.ptr ..] .type name[[count]]`.
fn param_size(p: &str) -> Option<usize> {
    let mut toks = p.split_whitespace();
    if toks.next() != Some(".param") {
        return None;
    }
    let toks: Vec<&str> = toks.collect();
    let elem = toks.iter().find_map(|t| type_size(t))?;
    let last = toks.last()?;
    let count = match (last.find('['), last.strip_suffix(']')) {
        (Some(b), Some(inner)) => inner.get(b + 1..)?.parse().ok()?,
        (None, None) => 1,
        _ => return None,
    };
    elem.checked_mul(count)
}

fn type_size(t: &str) -> Option<usize> {
    Some(match t {
        ".b8" | ".u8" | ".s8" => 1,
        ".b16" | ".u16" | ".s16" | ".f16" | ".bf16" => 2,
        ".b32" | ".u32" | ".s32" | ".f32" | ".f16x2" | ".bf16x2" => 4,
        ".b64" | ".u64" | ".s64" | ".f64" => 8,
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_of_llvm_ptx_give_their_parameter_sizes() {
        let ptx = "
.version 8.0
.target sm_70
.visible .entry scale_bf16(
	.param .f32 scale_bf16_param_0,
	.param .align 8 .b8 scale_bf16_param_1[16],
	.param .align 8 .b8 scale_bf16_param_2[16]
)                                       // @scale_bf16
{ ret; }
.visible .entry trap()
{ trap; }
.visible .entry mix(
	.param .u64 .ptr .global .align 4 mix_param_0,
	.param .u8 mix_param_1,
	.param .bf16x2 mix_param_2
)
{ ret; }
";
        let e = entry_params(ptx);
        assert_eq!(e["scale_bf16"], vec![4, 16, 16]);
        assert_eq!(e["trap"], Vec::<usize>::new());
        assert_eq!(e["mix"], vec![8, 1, 4]);
        assert_eq!(e.len(), 3);
    }

    #[test]
    fn a_list_that_does_not_parse_leaves_its_entry_out() {
        let e =
            entry_params(".entry odd(.param .weird x, .param .u32 y)\n.entry ok(.param .u32 y)");
        assert!(!e.contains_key("odd"));
        assert_eq!(e["ok"], vec![4]);
    }

    #[test]
    #[cfg_attr(
        host_ptx_stub,
        ignore = "this build's PTX is a stub (HOST_PTX_STUB=1): no entries to parse"
    )]
    fn the_builtin_kernels_parse_as_declared() {
        use kernel_abi::{Kernel, Params};
        fn sizes<K: Kernel>() -> &'static [usize] {
            <K::Params as Params>::SIZES
        }
        let e = entry_params(crate::ptx::PTX);
        assert_eq!(e["scale"], sizes::<gpu_kernels::scale>());
        assert_eq!(e["saxpy"], sizes::<gpu_kernels::saxpy>());
        assert_eq!(e["intensity"], sizes::<gpu_kernels::intensity>());
        assert_eq!(e["gate_wait"], sizes::<gpu_kernels::gate_wait>());
        assert_eq!(e["trap"], sizes::<gpu_kernels::trap>());
        assert_eq!(e["gather_rows"], sizes::<gpu_kernels::gather_rows>());
    }
}
