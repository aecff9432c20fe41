"""The Redis tier's budget index, as Lua scripts run by `RedisStore` (with `redis.max_bytes`).

Keys (one hash tag, so one node of a cluster holds all three): KEYS[1] a sorted set of our block
keys scored by last use (the server's microseconds), KEYS[2] a hash key -> size, KEYS[3] the byte
counter. `ADD` (ARGV: budget, ttl in us, the block key prefix, the block key length, then key,
size pairs) records new blocks, forgets those past the ttl and pops the oldest while the counter
is over the budget, at most `POPS_PER_CALL` a call: it returns the victims (the caller DELs them:
keys we wrote; a member that is not a block key of ours, of our length, is forgotten but never
returned, so nothing another writer put in the index makes the reply long or names a key we did
not write). The pop bound holds the reply (and the script's time in Redis) to what one call
expects whatever the counter says: a counter planted as a valid but huge number cannot make one
put pop the whole index (a reply longer than the put's allowance trips the data path's breaker);
eviction past the bound goes on with the next put, and an index found empty resets the
counter. `TOUCH` (ARGV:
'touch' or 'forget', then keys) moves keys to now, or drops them from the index (a block found
missing, expired, deleted, or not verifiable).

Another writer of our keys can break these records (a counter or a size that is not a number,
a key of another type, a member of 66 MiB): a size that is not a number counts 0, a counter that
is not a number of at most 20 digits is reset, a key of the wrong type fails the script in Redis,
which the store counts (`script_errors`) without failing the link, and nothing planted is copied
into a script (`HEAD_BYTES`, below): a 66 MiB member copied into Lua four times held Redis past
the data path's `timeout_s` (0.5 s), which tripped its breaker.
"""

POPS_PER_CALL = 1024      # index members one ADD may pop (victims: at most this many keys)

HEAD_BYTES = 4096          # an index member at the head past this (MEMORY USAGE) is not ours

# Nothing another writer planted is copied into the script (each copy holds Redis for every
# client: ~7 ms a MiB on a loaded box): the counter and a size are read only after STRLEN /
# HSTRLEN say they are short, and the head of the sorted set (the next to pop: the oldest) is
# measured first with MEMORY USAGE SAMPLES 1, which samples the skiplist from its head; a head
# past HEAD_BYTES is dropped by rank (ZREMRANGEBYRANK), never read.
ADD = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local function counter()
  if redis.call('STRLEN', KEYS[3]) > 20 then redis.call('DEL', KEYS[3]) return 0 end
  local c = redis.call('GET', KEYS[3])
  if c and not string.match(c, '^-?%d+$') then redis.call('DEL', KEYS[3]) return 0 end
  return tonumber(c or '0')
end
counter()
local function size(m)
  if redis.call('HSTRLEN', KEYS[2], m) > 20 then return nil end
  return tonumber(redis.call('HGET', KEYS[2], m))
end
local function forget(m)
  local s = size(m)
  redis.call('HDEL', KEYS[2], m)
  if s then redis.call('DECRBY', KEYS[3], s) end
  redis.call('ZREM', KEYS[1], m)
end
local function head()
  local n = redis.call('ZCARD', KEYS[1])
  if n == 0 then return nil end
  local used = redis.call('MEMORY', 'USAGE', KEYS[1], 'SAMPLES', 1)
  if used and used / n > HEAD then
    redis.call('ZREMRANGEBYRANK', KEYS[1], 0, 0)
    return false
  end
  return redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
end
for i = 5, #ARGV, 2 do
  if redis.call('HSETNX', KEYS[2], ARGV[i], ARGV[i + 1]) == 1 then
    redis.call('INCRBY', KEYS[3], ARGV[i + 1])
  end
  redis.call('ZADD', KEYS[1], now, ARGV[i])
end
local ttl = tonumber(ARGV[2])
if ttl > 0 then
  for _ = 1, 4096 do
    local h = head()
    if h == nil then break end
    if h then
      if tonumber(h[2]) > now - ttl then break end
      forget(h[1])
    end
  end
end
local victims = {}
local budget = tonumber(ARGV[1])
local prefix, keylen = ARGV[3], #ARGV[3] + tonumber(ARGV[4])
local pops = 0
while pops < POPS and counter() > budget do
  local h = head()
  if h == nil then redis.call('SET', KEYS[3], 0) break end
  pops = pops + 1
  if h then
    forget(h[1])
    if #h[1] == keylen and string.sub(h[1], 1, #prefix) == prefix then
      victims[#victims + 1] = h[1]
    end
  end
end
return victims
""".replace("POPS", str(POPS_PER_CALL)).replace("HEAD", str(HEAD_BYTES))

TOUCH = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
for i = 2, #ARGV do
  if ARGV[1] == 'touch' then
    redis.call('ZADD', KEYS[1], 'XX', now, ARGV[i])
  else
    local s = nil
    if redis.call('HSTRLEN', KEYS[2], ARGV[i]) <= 20 then
      s = tonumber(redis.call('HGET', KEYS[2], ARGV[i]))
    end
    redis.call('HDEL', KEYS[2], ARGV[i])
    if s then redis.call('DECRBY', KEYS[3], s) end
    redis.call('ZREM', KEYS[1], ARGV[i])
  end
end
return 0
"""
