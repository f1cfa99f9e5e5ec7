//! llama.cpp's file types (`llama_ftype`): the value of `general.file_type`,
//! the names llama-quantize accepts and the descriptions llama-bench prints.

use crate::GgmlType;

/// A `llama_ftype`. The discriminant is the value stored in `general.file_type`.
#[allow(non_camel_case_types)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u32)]
pub enum FileType {
    AllF32 = 0,
    F16 = 1,
    Q4_0 = 2,
    Q4_1 = 3,
    Q8_0 = 7,
    Q5_0 = 8,
    Q5_1 = 9,
    Q2_K = 10,
    Q3_K_S = 11,
    Q3_K_M = 12,
    Q3_K_L = 13,
    Q4_K_S = 14,
    Q4_K_M = 15,
    Q5_K_S = 16,
    Q5_K_M = 17,
    Q6_K = 18,
    IQ2_XXS = 19,
    IQ2_XS = 20,
    Q2_K_S = 21,
    IQ3_XS = 22,
    IQ3_XXS = 23,
    IQ1_S = 24,
    IQ4_NL = 25,
    IQ3_S = 26,
    IQ3_M = 27,
    IQ2_S = 28,
    IQ2_M = 29,
    IQ4_XS = 30,
    IQ1_M = 31,
    BF16 = 32,
    TQ1_0 = 36,
    TQ2_0 = 37,
    MXFP4_MOE = 38,
    NVFP4 = 39,
    Q1_0 = 40,
    Q2_0 = 41,
}

/// Bit llama.cpp sets in the file type it infers for files without `general.file_type`.
pub const FILE_TYPE_GUESSED: u32 = 1024;

struct Entry {
    ftype: FileType,
    /// The name llama-quantize takes on its command line.
    name: &'static str,
    /// `llama_model_ftype_name`, as shown in llama-bench's model column.
    description: &'static str,
    /// The type of the bulk of the weights (`llama_ftype_get_default_type`).
    default_type: GgmlType,
}

const fn entry(ftype: FileType, name: &'static str, description: &'static str, default_type: GgmlType) -> Entry {
    Entry { ftype, name, description, default_type }
}

use FileType as F;
use GgmlType as G;

/// Every file type llama.cpp defines. The IQ1/IQ2 mixes, IQ3_XXS and Q2_K_S need an
/// importance matrix for most tensors (llama-quantize refuses them without one): they are
/// planned, and refused per tensor unless `allow_without_imatrix` is asked for.
const ENTRIES: &[Entry] = &[
    entry(F::Q4_0, "Q4_0", "Q4_0", G::Q4_0),
    entry(F::Q4_1, "Q4_1", "Q4_1", G::Q4_1),
    entry(F::Q5_0, "Q5_0", "Q5_0", G::Q5_0),
    entry(F::Q5_1, "Q5_1", "Q5_1", G::Q5_1),
    entry(F::IQ2_XXS, "IQ2_XXS", "IQ2_XXS - 2.0625 bpw", G::IQ2_XXS),
    entry(F::IQ2_XS, "IQ2_XS", "IQ2_XS - 2.3125 bpw", G::IQ2_XS),
    entry(F::IQ2_S, "IQ2_S", "IQ2_S - 2.5 bpw", G::IQ2_XS),
    entry(F::IQ2_M, "IQ2_M", "IQ2_M - 2.7 bpw", G::IQ2_S),
    entry(F::IQ1_S, "IQ1_S", "IQ1_S - 1.5625 bpw", G::IQ1_S),
    entry(F::IQ1_M, "IQ1_M", "IQ1_M - 1.75 bpw", G::IQ1_M),
    entry(F::TQ1_0, "TQ1_0", "TQ1_0 - 1.69 bpw ternary", G::TQ1_0),
    entry(F::TQ2_0, "TQ2_0", "TQ2_0 - 2.06 bpw ternary", G::TQ2_0),
    entry(F::Q2_K, "Q2_K", "Q2_K - Medium", G::Q2_K),
    entry(F::Q2_K_S, "Q2_K_S", "Q2_K - Small", G::Q2_K),
    entry(F::IQ3_XXS, "IQ3_XXS", "IQ3_XXS - 3.0625 bpw", G::IQ3_XXS),
    entry(F::IQ3_S, "IQ3_S", "IQ3_S - 3.4375 bpw", G::IQ3_S),
    entry(F::IQ3_M, "IQ3_M", "IQ3_S mix - 3.66 bpw", G::IQ3_S),
    entry(F::Q3_K_S, "Q3_K_S", "Q3_K - Small", G::Q3_K),
    entry(F::Q3_K_M, "Q3_K_M", "Q3_K - Medium", G::Q3_K),
    entry(F::Q3_K_L, "Q3_K_L", "Q3_K - Large", G::Q3_K),
    entry(F::IQ4_NL, "IQ4_NL", "IQ4_NL - 4.5 bpw", G::IQ4_NL),
    entry(F::IQ4_XS, "IQ4_XS", "IQ4_XS - 4.25 bpw", G::IQ4_XS),
    entry(F::Q4_K_S, "Q4_K_S", "Q4_K - Small", G::Q4_K),
    entry(F::Q4_K_M, "Q4_K_M", "Q4_K - Medium", G::Q4_K),
    entry(F::Q5_K_S, "Q5_K_S", "Q5_K - Small", G::Q5_K),
    entry(F::Q5_K_M, "Q5_K_M", "Q5_K - Medium", G::Q5_K),
    entry(F::Q6_K, "Q6_K", "Q6_K", G::Q6_K),
    entry(F::Q8_0, "Q8_0", "Q8_0", G::Q8_0),
    entry(F::Q1_0, "Q1_0", "Q1_0", G::Q1_0),
    entry(F::Q2_0, "Q2_0", "Q2_0", G::Q2_0),
    entry(F::MXFP4_MOE, "MXFP4_MOE", "MXFP4 MoE", G::MXFP4),
    entry(F::NVFP4, "NVFP4", "NVFP4", G::NVFP4),
    entry(F::F16, "F16", "F16", G::F16),
    entry(F::BF16, "BF16", "BF16", G::BF16),
    entry(F::AllF32, "F32", "all F32", G::F32),
    // Its mix puts IQ3_XXS on attn_q/attn_k/ffn_gate/ffn_up, which needs an importance
    // matrix: only --pure (all IQ3_S) gets past planning, as in llama-quantize.
    entry(F::IQ3_XS, "IQ3_XS", "IQ3_XS - 3.3 bpw", G::IQ3_S),
];

/// llama-quantize's short names for the medium K-quant mixes.
const ALIASES: &[(&str, FileType)] = &[("Q3_K", F::Q3_K_M), ("Q4_K", F::Q4_K_M), ("Q5_K", F::Q5_K_M)];

impl FileType {
    fn entry(self) -> &'static Entry {
        ENTRIES.iter().find(|e| e.ftype == self).expect("every file type has an entry")
    }

    pub fn id(self) -> u32 {
        self as u32
    }

    pub fn from_id(id: u32) -> Option<FileType> {
        ENTRIES.iter().find(|e| e.ftype as u32 == id).map(|e| e.ftype)
    }

    /// The name llama-quantize uses, e.g. "Q4_K_M".
    pub fn name(self) -> &'static str {
        self.entry().name
    }

    /// llama.cpp's description, e.g. "Q4_K - Medium".
    pub fn description(self) -> &'static str {
        self.entry().description
    }

    /// The type most weights get.
    pub fn default_type(self) -> GgmlType {
        self.entry().default_type
    }

    /// Every file type llama.cpp defines; kiln writes each of them (those that llama-quantize
    /// makes only with an importance matrix through `kiln dev random-model`).
    pub fn all() -> impl Iterator<Item = FileType> {
        ENTRIES.iter().map(|e| e.ftype)
    }

    /// Parses a llama-quantize type argument: a name (any case), one of the
    /// aliases Q3_K/Q4_K/Q5_K, or a numeric file type id.
    pub fn parse(arg: &str) -> Option<FileType> {
        let by_name = ENTRIES.iter().find(|e| e.name.eq_ignore_ascii_case(arg)).map(|e| e.ftype);
        let by_alias = || ALIASES.iter().find(|(a, _)| a.eq_ignore_ascii_case(arg)).map(|(_, f)| *f);
        let by_id = || arg.parse::<u32>().ok().and_then(FileType::from_id);
        by_name.or_else(by_alias).or_else(by_id)
    }

    /// The file type llama.cpp infers from the most common tensor type when a
    /// file has no `general.file_type` (without the [`FILE_TYPE_GUESSED`] bit).
    pub fn guess_from(ty: GgmlType) -> Option<FileType> {
        Some(match ty {
            G::F32 => F::AllF32,
            G::F16 => F::F16,
            G::BF16 => F::BF16,
            G::Q4_0 => F::Q4_0,
            G::Q4_1 => F::Q4_1,
            G::Q5_0 => F::Q5_0,
            G::Q5_1 => F::Q5_1,
            G::Q8_0 => F::Q8_0,
            G::Q2_K => F::Q2_K,
            G::Q3_K => F::Q3_K_M,
            G::Q4_K => F::Q4_K_M,
            G::Q5_K => F::Q5_K_M,
            G::Q6_K => F::Q6_K,
            G::TQ1_0 => F::TQ1_0,
            G::TQ2_0 => F::TQ2_0,
            G::IQ2_XXS => F::IQ2_XXS,
            G::IQ2_XS => F::IQ2_XS,
            G::IQ2_S => F::IQ2_S,
            G::IQ3_XXS => F::IQ3_XXS,
            G::IQ1_S => F::IQ1_S,
            G::IQ1_M => F::IQ1_M,
            G::IQ4_NL => F::IQ4_NL,
            G::IQ4_XS => F::IQ4_XS,
            G::IQ3_S => F::IQ3_S,
            G::Q1_0 => F::Q1_0,
            G::Q2_0 => F::Q2_0,
            G::MXFP4 => F::MXFP4_MOE,
            G::NVFP4 => F::NVFP4,
            _ => return None,
        })
    }
}

/// llama.cpp's `llama_model_ftype_name` for a raw `general.file_type` value,
/// including the " (guessed)" suffix.
pub fn describe_file_type(id: u32) -> String {
    if id & FILE_TYPE_GUESSED != 0 {
        return format!("{} (guessed)", describe_file_type(id & !FILE_TYPE_GUESSED));
    }
    match FileType::from_id(id) {
        Some(f) => f.description().to_string(),
        None => "unknown, may not work".to_string(),
    }
}

impl std::fmt::Display for FileType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_names_and_aliases_round_trip() {
        for e in ENTRIES {
            assert_eq!(FileType::from_id(e.ftype.id()), Some(e.ftype));
            assert_eq!(FileType::parse(e.name), Some(e.ftype));
            assert_eq!(FileType::parse(&e.name.to_lowercase()), Some(e.ftype));
        }
        assert_eq!(FileType::parse("q4_k"), Some(FileType::Q4_K_M));
        assert_eq!(FileType::parse("15"), Some(FileType::Q4_K_M));
        assert_eq!(FileType::parse("Q7_K"), None);
        assert_eq!(FileType::parse("Q8_K"), None);
        assert_eq!(FileType::Q4_K_M.id(), 15);
        assert_eq!(FileType::Q1_0.id(), 40);
        assert_eq!(FileType::Q2_0.id(), 41);
        assert_eq!(FileType::parse("nvfp4").map(FileType::default_type), Some(GgmlType::NVFP4));
        assert_eq!(describe_file_type(15), "Q4_K - Medium");
        assert_eq!(describe_file_type(15 | FILE_TYPE_GUESSED), "Q4_K - Medium (guessed)");
        assert_eq!(describe_file_type(999), "unknown, may not work");
    }

    #[test]
    fn every_file_type_defaults_to_a_type_kiln_quant_encodes() {
        for f in FileType::all() {
            let ty = f.default_type();
            assert!(crate::can_quantize(ty), "{f} defaults to {ty}, which kiln-quant cannot encode");
        }
    }
}
