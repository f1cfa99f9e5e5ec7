//! `strftime` for `strftime_now()`, without a date-time dependency. Times are UTC.

/// (year, month 1-12, day 1-31) of a day count since 1970-01-01 (proleptic Gregorian).
fn civil_from_days(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let month = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    (yoe + era * 400 + i64::from(month <= 2), month, day)
}

/// Days from 1970-01-01 to January 1st of `year`.
fn civil_days_before_year(year: i64) -> i64 {
    let y = year - 1;
    let leap_days = |y: i64| y.div_euclid(4) - y.div_euclid(100) + y.div_euclid(400);
    365 * (year - 1970) + leap_days(y) - leap_days(1969)
}

/// Seconds since the Unix epoch of a UTC date and time; `None` when a field is out of range.
pub fn unix_seconds(year: i64, month: u32, day: u32, hour: u32, minute: u32, second: u32) -> Option<i64> {
    if !(1..=12).contains(&month) || hour > 23 || minute > 59 || second > 59 {
        return None;
    }
    let leap = (year % 4 == 0 && year % 100 != 0) || year % 400 == 0;
    let month_days = [31, if leap { 29 } else { 28 }, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31];
    if day == 0 || day > month_days[month as usize - 1] {
        return None;
    }
    let day_of_year: i64 = month_days[..month as usize - 1].iter().map(|&d| i64::from(d)).sum::<i64>() + i64::from(day) - 1;
    let days = civil_days_before_year(year) + day_of_year;
    Some(days * 86_400 + i64::from(hour) * 3600 + i64::from(minute) * 60 + i64::from(second))
}

const MONTHS: [&str; 12] = ["January", "February", "March", "April", "May", "June", "July", "August", "September", "October", "November", "December"];
const WEEKDAYS: [&str; 7] = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"];

/// C `strftime` for the directives chat templates use, at `unix_secs` (UTC).
pub fn strftime(format: &str, unix_secs: i64) -> String {
    let days = unix_secs.div_euclid(86_400);
    let secs = unix_secs.rem_euclid(86_400);
    let (year, month, day) = civil_from_days(days);
    let (hour, minute, second) = (secs / 3600, secs / 60 % 60, secs % 60);
    // 1970-01-01 was a Thursday.
    let weekday_index = (days + 3).rem_euclid(7) as usize;
    let weekday = WEEKDAYS[weekday_index];
    let month_name = MONTHS[month as usize - 1];
    let day_of_year = days - civil_days_before_year(year) + 1;
    let mut out = String::new();
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('Y') => out += &year.to_string(),
            Some('y') => out += &format!("{:02}", year.rem_euclid(100)),
            Some('m') => out += &format!("{month:02}"),
            Some('d') => out += &format!("{day:02}"),
            Some('e') => out += &format!("{day:2}"),
            Some('-') => match chars.next() {
                // glibc's "no padding" flag, common in templates ("%-d").
                Some('d') => out += &day.to_string(),
                Some('m') => out += &month.to_string(),
                Some('H') => out += &hour.to_string(),
                Some('M') => out += &minute.to_string(),
                Some(other) => out.extend(['%', '-', other]),
                None => out += "%-",
            },
            Some('B') => out += month_name,
            Some('b') | Some('h') => out += &month_name[..3],
            Some('A') => out += weekday,
            Some('a') => out += &weekday[..3],
            Some('u') => out += &(weekday_index + 1).to_string(),
            Some('w') => out += &((weekday_index + 1) % 7).to_string(),
            Some('H') => out += &format!("{hour:02}"),
            Some('I') => out += &format!("{:02}", (hour + 11) % 12 + 1),
            Some('p') => out += if hour < 12 { "AM" } else { "PM" },
            Some('M') => out += &format!("{minute:02}"),
            Some('S') => out += &format!("{second:02}"),
            Some('j') => out += &format!("{day_of_year:03}"),
            Some('F') => out += &format!("{year}-{month:02}-{day:02}"),
            Some('T') => out += &format!("{hour:02}:{minute:02}:{second:02}"),
            Some('%') => out.push('%'),
            Some(other) => out.extend(['%', other]),
            None => out.push('%'),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strftime_known_instant() {
        // 2024-02-29T13:05:09Z, a Thursday, day 60 of a leap year.
        let t = 1_709_211_909;
        assert_eq!(strftime("%Y-%m-%d %H:%M:%S", t), "2024-02-29 13:05:09");
        assert_eq!(strftime("%d %b %Y, %A %a %B %j %I%p %-d/%-m %%", t), "29 Feb 2024, Thursday Thu February 060 01PM 29/2 %");
        assert_eq!(strftime("%F %T %u %w", t), "2024-02-29 13:05:09 4 4");
        assert_eq!(strftime("%Y-%m-%d", 0), "1970-01-01");
        assert_eq!(strftime("%Y-%m-%d %j", 951_782_400), "2000-02-29 060");
    }

    #[test]
    fn unix_seconds_inverts_strftime() {
        assert_eq!(unix_seconds(2024, 2, 29, 13, 5, 9), Some(1_709_211_909));
        assert_eq!(unix_seconds(1970, 1, 1, 0, 0, 0), Some(0));
        assert_eq!(unix_seconds(2023, 2, 29, 0, 0, 0), None);
        assert_eq!(unix_seconds(2026, 13, 1, 0, 0, 0), None);
    }
}
