//! GGUF metadata value types and values.

use std::fmt;

/// The type tag of a GGUF metadata value, with its on-disk id.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u32)]
pub enum ValueType {
    U8 = 0,
    I8 = 1,
    U16 = 2,
    I16 = 3,
    U32 = 4,
    I32 = 5,
    F32 = 6,
    Bool = 7,
    String = 8,
    Array = 9,
    U64 = 10,
    I64 = 11,
    F64 = 12,
}

impl ValueType {
    /// The type for an on-disk id, or `None` for an unknown id.
    pub fn from_id(id: u32) -> Option<ValueType> {
        use ValueType::*;
        Some(match id {
            0 => U8,
            1 => I8,
            2 => U16,
            3 => I16,
            4 => U32,
            5 => I32,
            6 => F32,
            7 => Bool,
            8 => String,
            9 => Array,
            10 => U64,
            11 => I64,
            12 => F64,
            _ => return None,
        })
    }

    pub fn id(self) -> u32 {
        self as u32
    }

    pub const fn name(self) -> &'static str {
        use ValueType::*;
        match self {
            U8 => "u8",
            I8 => "i8",
            U16 => "u16",
            I16 => "i16",
            U32 => "u32",
            I32 => "i32",
            F32 => "f32",
            Bool => "bool",
            String => "string",
            Array => "array",
            U64 => "u64",
            I64 => "i64",
            F64 => "f64",
        }
    }

    /// The fewest bytes one value of this type occupies on disk; bounds
    /// element counts against the bytes left before anything is allocated.
    pub(crate) const fn min_encoded_size(self) -> u64 {
        use ValueType::*;
        match self {
            U8 | I8 | Bool => 1,
            U16 | I16 => 2,
            U32 | I32 | F32 => 4,
            U64 | I64 | F64 => 8,
            // u64 length
            String => 8,
            // u32 element type + u64 length
            Array => 12,
        }
    }
}

impl fmt::Display for ValueType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A GGUF metadata value.
#[derive(Clone, Debug, PartialEq)]
pub enum Value {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    String(String),
    U64(u64),
    I64(i64),
    F64(f64),
    /// Element type and elements; every element has the element type.
    Array(ValueType, Vec<Value>),
}

impl Value {
    pub fn value_type(&self) -> ValueType {
        match self {
            Value::U8(_) => ValueType::U8,
            Value::I8(_) => ValueType::I8,
            Value::U16(_) => ValueType::U16,
            Value::I16(_) => ValueType::I16,
            Value::U32(_) => ValueType::U32,
            Value::I32(_) => ValueType::I32,
            Value::F32(_) => ValueType::F32,
            Value::Bool(_) => ValueType::Bool,
            Value::String(_) => ValueType::String,
            Value::U64(_) => ValueType::U64,
            Value::I64(_) => ValueType::I64,
            Value::F64(_) => ValueType::F64,
            Value::Array(..) => ValueType::Array,
        }
    }

    /// Any integer (not bool) as i128, which holds every GGUF integer exactly.
    fn as_i128(&self) -> Option<i128> {
        Some(match *self {
            Value::U8(v) => v.into(),
            Value::I8(v) => v.into(),
            Value::U16(v) => v.into(),
            Value::I16(v) => v.into(),
            Value::U32(v) => v.into(),
            Value::I32(v) => v.into(),
            Value::U64(v) => v.into(),
            Value::I64(v) => v.into(),
            _ => return None,
        })
    }

    /// Any integer type whose value is >= 0 (bool excluded).
    pub fn as_u64(&self) -> Option<u64> {
        self.as_i128().and_then(|v| u64::try_from(v).ok())
    }

    /// Any integer type whose value fits in i64 (bool excluded).
    pub fn as_i64(&self) -> Option<i64> {
        self.as_i128().and_then(|v| i64::try_from(v).ok())
    }

    /// Any float or integer (large 64-bit integers round to the nearest f64).
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            Value::F32(v) => Some(v.into()),
            Value::F64(v) => Some(v),
            _ => self.as_i128().map(|v| v as f64),
        }
    }

    /// Any float or integer, rounded to f32.
    pub fn as_f32(&self) -> Option<f32> {
        match *self {
            Value::F32(v) => Some(v),
            _ => self.as_f64().map(|v| v as f32),
        }
    }

    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            Value::Bool(v) => Some(v),
            _ => None,
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::String(s) => Some(s),
            _ => None,
        }
    }

    pub fn as_array(&self) -> Option<&[Value]> {
        match self {
            Value::Array(_, items) => Some(items),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn value_type_ids_round_trip() {
        for id in 0..13 {
            assert_eq!(ValueType::from_id(id).unwrap().id(), id);
        }
        assert_eq!(ValueType::from_id(13), None);
        assert_eq!(ValueType::from_id(u32::MAX), None);
    }

    #[test]
    fn integer_conversions_respect_range() {
        assert_eq!(Value::I32(-1).as_u64(), None);
        assert_eq!(Value::I32(-1).as_i64(), Some(-1));
        assert_eq!(Value::U64(u64::MAX).as_i64(), None);
        assert_eq!(Value::U64(u64::MAX).as_u64(), Some(u64::MAX));
        assert_eq!(Value::U8(7).as_u64(), Some(7));
        assert_eq!(Value::Bool(true).as_u64(), None);
        assert_eq!(Value::F32(1.0).as_u64(), None);
        assert_eq!(Value::I16(-3).as_f64(), Some(-3.0));
        assert_eq!(Value::F64(0.5).as_f32(), Some(0.5));
        assert_eq!(Value::String("x".into()).as_f64(), None);
        assert_eq!(Value::Bool(false).as_bool(), Some(false));
        assert_eq!(Value::U8(0).as_bool(), None);
        let arr = Value::Array(ValueType::U8, vec![Value::U8(1)]);
        assert_eq!(arr.as_array().map(|a| a.len()), Some(1));
        assert_eq!(arr.value_type(), ValueType::Array);
        assert_eq!(Value::String("ab".into()).as_str(), Some("ab"));
    }
}
