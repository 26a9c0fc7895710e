-- uses: zero_counts
-- A done mark whose result object is gone (deleted by hand, another store): forget it and the
-- batch's counts, unless a run owns it. 0: a run owns it, 1: nothing does.
-- KEYS: owner, done, stats, bstats, progress; ARGV: batch.
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
if redis.call('SREM', KEYS[2], ARGV[1]) == 1 then
  redis.call('DEL', KEYS[5])
  zero_counts(KEYS[3], KEYS[4], ARGV[1])
end
return 1
