-- uses: zero_counts
-- Claim a batch for a run. {'held', holder} while another live run owns it; {'done', ''} when
-- it is marked done and the caller does not reopen it; else {'ok', previous holder or ''}.
-- KEYS: owner, done, stats, bstats, progress
-- ARGV: batch, token, ttl ms, reopen ('1': the store lacks the result, drop a stale done mark),
--       the token of a holder known to be dead ('' if none)
local cur = redis.call('GET', KEYS[1])
if cur and cur ~= ARGV[2] and cur ~= ARGV[5] then return {'held', cur} end
if redis.call('SISMEMBER', KEYS[2], ARGV[1]) == 1 then
  if ARGV[4] ~= '1' then return {'done', ''} end
  redis.call('SREM', KEYS[2], ARGV[1])
  redis.call('DEL', KEYS[5])
  zero_counts(KEYS[3], KEYS[4], ARGV[1])
end
redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
return {'ok', cur or ''}
